"""Shared test settings.

Hypothesis profiles: ``ci`` (default) keeps the suite bounded on a 2-core
machine; ``long`` explores far more (``JAXKV_HYPOTHESIS=long pytest -m slow``).
"""

import os
import re
import time

# Compile time dominates this suite (thousands of small XLA programs on a
# 2-core CPU), and the programs are too small for slower code to matter:
# LLVM -O0 compiles about a third faster, and XLA:CPU's older loop emitters
# instead of its MLIR fusion emitters save another quarter to a third of a
# test's time (test_penalties 16.7 -> 12.7 s, two engine tests 34 -> 21 s,
# measured alone on the 2-core VM, 2026-11-29). Read when JAX starts its
# backend, i.e. after this file; subprocesses (the examples) inherit it.
_TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _TEST_XLA_FLAGS).strip()

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ``ci`` was 30 examples of 60 steps until CI's VM slowed 2.2x (2026-11-29); each run draws fresh examples.
settings.register_profile("ci", max_examples=20, stateful_step_count=40, **_COMMON)
settings.register_profile("long", max_examples=400, stateful_step_count=100, **_COMMON)
settings.load_profile(os.environ.get("JAXKV_HYPOTHESIS", "ci"))


def _cuda_plugin() -> bool:
    from kernels_pallas._gpu import cuda_plugin_available

    return cuda_plugin_available()


# ============================================================================ which tests are in which pass
#
# The README's command (``python -m pytest -q -n 2``) runs every test not marked ``long`` (pyproject's
# ``addopts = "-m 'not long'"``); ``.ci/run`` then runs ``pytest -m long``, then ``-m aot``; ``-m gpu``
# runs on a GPU machine (docs/testing.md). The ``long`` and ``aot`` marks are given HERE, by the rules of
# RULES below, never in the test files: a row gives the mark, the cost class, the tests it takes, and why.
#
# Tests are named by node id under tests/ (what ``pytest --collect-only -q`` prints, less ``tests/``):
# ``*`` stands for any text; a pattern without ``[...]`` takes every case of a test, one with ``[...]``
# the cases whose id matches; a pattern starting with ``!`` takes back what the row's other patterns
# took. A row may also be a function of the item. A pattern that matches nothing in a module that was
# collected stops the run (exit 4), so a renamed test cannot slip into the default pass unnoticed.
#
# The cost classes of ``long`` (the costs are a 2-core CPU's: compile time dominates):
#   wide twin     the wider run of a default test (more seeds, draws, hypothesis examples), named so:
#                 ``test_*_wide``, ``test_*_long``, ``test_*_sweep``, or a case ``*-wide``
#   wide parity   transformers' tokens on every drawn configuration (tests/fixtures/parity/README.md)
#   other cases   a test run over families, dtypes or layouts: one case by default, the others long
#   program       a whole program end to end: a demo, an example, a benchmark, a server process
#   fuzz          engine fuzz and state machines beyond the one the default pass runs
#   second route  a costlier second check of a behaviour the default pass checks elsewhere
#
# Not here: ``gpu`` marks a kernel test's ``compiled`` case (KERNEL_MODES in tests/util.py) and
# test_nn_generate's Pallas test, and ``slow`` the bounded hypothesis state machines where they are built
# (``pytest.mark.slow(Machine.TestCase)``).


def _drawn_configuration(item) -> bool:
    """test_parity_*.py: a case of the ``name`` parameter that is not in the
    module's ``DEFAULT`` (a dict family -> name, or a list of names)."""
    callspec = getattr(item, "callspec", None)
    if not item.path.name.startswith("test_parity_") or callspec is None or "name" not in callspec.params:
        return False
    default = item.module.DEFAULT
    return callspec.params["name"] not in (default.values() if isinstance(default, dict) else default)


RULES = (
    # mark, cost class, tests, why
    ("long", "wide twin", ("*_wide", "*_long", "*_sweep", "*[*-wide]"),
     "more seeds, draws or hypothesis examples than the default tests of the same module"),
    ("long", "wide parity", _drawn_configuration,
     "test_parity_configs, test_parity_dsv4: by default each family's DEFAULT configuration (none for "
     "DeepSeek-V4, whose tokens meet transformers by default in test_nn_deepseek_v4)"),
    ("long", "wide parity", ("test_parity_configs.py::test_engine_equals_transformers[qwen3_next_*]",
                             "test_parity_configs.py::test_engine_equals_transformers[dsv3_*]"),
     "the engine's parity run is Llama's default configuration; DeepSeek-V3 on the engine: "
     "test_nn_qwen3_next_dsv3.test_dsv3_runs_on_the_engine"),

    ("long", "other cases", ("test_engine_families.py::test_engine_tokens_equal_transformers_under_preemption"
                             "[gemma3/small]",
                             "test_engine_families.py::test_engine_tokens_equal_transformers_under_preemption"
                             "[qwen3_next/small]"),
     "gpt-oss by default (Gemma 3 runs the same window-ring code)"),
    ("long", "other cases", ("test_engine_families.py::test_hybrid_prefix_hits_give_the_cold_tokens",),
     "every family; the gpt-oss engine fuzz (test_fuzz_engine_hybrid) checks hits against cold runs by default"),
    ("long", "other cases", ("test_engine_sizing.py::test_engine_with_no_sizing_argument_serves_every_family"
                             "[dsv4/small]",),
     "Qwen3-Next covers the hybrid cache's sizing rule by default"),
    ("long", "other cases", ("test_hybrid_host.py::test_swapped_request_decodes_as_if_never_swapped"
                             "[deepseek_v4]",),
     "Qwen3-Next by default"),
    ("long", "other cases", ("test_disaggregated.py::test_every_family_decodes_what_another_engine_prefilled[*]",),
     "the tiny Llama's hand-over runs by default (each family here builds three engines, 20-60 s)"),
    ("long", "other cases", ("test_server_disaggregated.py::*",),
     "a prefill and a decode server process (about 50 s); the hand-over itself runs by default in "
     "test_disaggregated"),
    ("long", "other cases", ("test_server_processes.py::*",),
     "two server processes in one jax.distributed run, then one killed (about 40 s); the lockstep engine loop's "
     "code runs in every server test (it publishes nothing without --num-processes)"),
    ("long", "other cases", ("test_server_disk.py::*",),
     "two server processes started one after the other (about a minute); the engine's restarts are tested by "
     "default in test_disk_tier"),
    ("long", "other cases", ("test_bench_smoke.py::test_serve_disaggregated_gives_one_servers_outputs",),
     "three server processes one after the other (about two minutes); test_server_disaggregated runs the pair"),
    ("long", "other cases", ("test_bench_smoke.py::test_prefix_restart_times_a_hit_from_the_disk_tier",),
     "SmolLM2 engines built three times (about 40 s); the disk tier's hits are tested by default in "
     "test_disk_tier"),
    ("long", "other cases", ("test_disk_tier.py::test_every_family_hits_its_disk_after_a_restart[*]",),
     "the tiny Llama's restarts, damage and budget run by default (the same disk code; each family here "
     "compiles its engine three times, 20-40 s)"),
    ("long", "other cases", ("test_hybrid_prefix_tiers.py::test_a_prefix_dropped_to_host_comes_back_exact",),
     "DeepSeek-V4 (every group's blocks and its rings through the host tier), its only case"),
    ("long", "other cases", ("test_isolation.py::test_poisoned_and_reused_blocks_never_reach_a_live_sequence[*]",
                             "!test_isolation.py::test_poisoned_and_reused_blocks_never_reach_a_live_sequence"
                             "[bfloat16]",
                             "test_isolation.py::test_manager_tables_feed_jax_pallas_paged_attention"
                             "[float8_e4m3fn]"),
     "bfloat16 (float32) by default: every pool stores raw bits alike"),
    ("long", "second route", ("test_scan_layers.py::test_a_scanned_llama_is_the_unrolled_one",),
     "whole scanned Llamas against unrolled ones (about 20 s each); by default the scanned Qwen3-Next fixture "
     "meets transformers (qwen3_next/defaults)"),
    ("long", "other cases", ("test_scan_interleaved.py::test_a_scanned_interleaved_model_is_the_unrolled_one[*]",
                             "test_scan_layers.py::test_a_scanned_qwen3_next_is_the_unrolled_one"),
     "whole scanned models (see the row above); Gemma 3's two runs "
     "(an inner scan) and gpt-oss's runs of one in long (about 50 s each); Qwen3-Next's transformers fixture "
     "qwen3_next/defaults runs scanned in the default pass"),
    ("long", "program", ("test_experts_mesh.py::test_sharded_experts_equal_one_device",
                         "test_experts_mesh.py::test_sharded_moe_families_equal_one_device"),
     "a subprocess on eight CPU devices (about a minute); the placement rule is checked by default"),
    ("long", "program", ("test_mesh.py::test_one_process_eight_devices",),
     "a subprocess on eight CPU devices per family (about 30 s each); the placement rules of heads and experts "
     "are checked by default (test_heads_mesh, test_experts_mesh, test_sharding_rules)"),
    ("long", "other cases", ("test_parallel_hybrid.py::test_each_sample_replays_an_unshared_no_cache_run",
                             "!test_parallel_hybrid.py::test_each_sample_replays_an_unshared_no_cache_run"
                             "[gpt_oss/small]"),
     "gpt-oss by default (window rings, sinks and paged blocks forked)"),
    ("long", "other cases", ("test_speculative.py::test_greedy_speculative_generate_gives_transformers_tokens[*]",
                             "!test_speculative.py::test_greedy_speculative_generate_gives_transformers_tokens"
                             "[parity/llama_3]",
                             "test_speculative.py::test_hybrid_rollback_equals_a_cache_that_never_saw_the_rejected_"
                             "tokens[*]",
                             "!test_speculative.py::test_hybrid_rollback_equals_a_cache_that_never_saw_the_rejected_"
                             "tokens[parity/qwen3_next_2]"),
     "the paged Llama's tokens and the Gated DeltaNet Qwen3-Next's rollback by default; window rings (Gemma 3, "
     "gpt-oss), DeepSeek-V3 and DeepSeek-V4's compressors roll back through the same checkpoint and replay"),
    ("long", "other cases", ("test_speculative.py::test_hybrid_packed_verify_equals_a_cache_that_never_saw_the_"
                             "rejected_tokens[*]",
                             "!test_speculative.py::test_hybrid_packed_verify_equals_a_cache_that_never_saw_the_"
                             "rejected_tokens[parity/qwen3_next_2]",
                             "test_speculative.py::test_hybrid_packed_steps_verify_drafts_beside_prompt_pieces[*]"),
     "a hybrid packed step's verify lanes checked exactly on Qwen3-Next's Gated DeltaNet (checkpoint and replay) "
     "by default; the window rings' (rolled back by length) and DeepSeek-V4's stores, and every hybrid family's "
     "engine with verify lanes beside prompt pieces (about 60 s each), in long"),
    ("long", "other cases", ("test_speculative.py::test_early_exit_drafts_verify_in_packed_steps[first_layer]",),
     "the whole target as its own early exit by default (every draft verified in a packed step kept: the "
     "stronger check of the same path); an untrained first layer's drafts in long"),
    ("long", "other cases", ("test_speculative.py::test_hybrid_engine_speculates_with_generate_tokens_under_"
                             "preemption_and_prefix_hits[*]",),
     "the hybrid caches' rollback by default (test_hybrid_rollback_equals_a_cache_that_never_saw_the_rejected_"
     "tokens on Qwen3-Next's Gated DeltaNet) and the paged engine's speculation; the hybrid engines' (Gemma 3's "
     "window rings, Qwen3-Next, gpt-oss's sinks; about 70 s each) in long, with the hybrid engine fuzz"),
    ("long", "other cases", ("test_speculative.py::test_a_speculating_engine_swaps_aborts_and_keeps_tenants_apart"
                             "[separate]",
                             "test_speculative.py::test_a_hybrid_target_drafts_with_a_separate_paged_model",
                             "test_speculative.py::test_a_separate_draft_cache_plans_for_a_small_pool_and_a_"
                             "catch_up_cap",
                             "test_speculative.py::test_a_ragged_append_equals_appending_each_row_alone[1]",
                             "test_speculative.py::test_a_ragged_append_equals_appending_each_row_alone[2]"),
     "a separate draft model's cache runs by default under preemption and prefix hits (the paged Llama); a small "
     "draft pool with a catch-up cap, swap, abort and tenants with it, a hybrid target (Gemma 3) and two more "
     "seeds of the ragged append in long (about 2 minutes together)"),
    ("long", "other cases", ("test_speculative.py::test_paged_rollback_equals_a_cache_that_never_saw_the_rejected_"
                             "tokens[*-1]",),
     "a second seed of the paged rollback check (seed 0 runs by default, given drafts and an early exit's)"),
    ("long", "second route", ("test_speculative.py::test_copying_text_is_accepted_and_sampled_runs_finish",
                              "test_speculative.py::test_engine_turns_speculation_off_for_a_request_that_keeps_few_"
                              "drafts",
                              "test_speculative.py::test_draft_models_give_the_target_tokens_and_a_perfect_draft_is_"
                              "always_kept",
                              "test_speculative.py::test_a_speculating_engine_recovers_from_a_failed_step_with_its_"
                              "lookahead"),
     "speculation's default tests check the rollback of every cache kind's pieces, the rule, the engine under "
     "preemption and prefix hits, and transformers' tokens; these add the copy-heavy generate loop, the off rule, "
     "draft models and a contained fault (about 45 s together)"),
    ("long", "other cases", ("test_speculative.py::test_a_speculating_engine_swaps_aborts_and_keeps_tenants_apart"
                             "[early_exit]",
                             "test_speculative.py::test_early_exit_engine_gives_generate_tokens_for_each_paged_family",
                             "test_speculative.py::test_early_exit_drafts_in_the_engine_keep_the_target_distribution"),
     "the engine's early-exit draft runs by default under preemption and prefix hits (the Llama pool); these add "
     "swap, abort and tenants with it, DeepSeek-V3's MLA pool, and the sampled distribution over 1,536 requests "
     "twice (about 50 s together)"),
    ("long", "other cases", ("test_logprobs.py::test_engine_logprobs_equal_a_no_cache_forward",
                             "!test_logprobs.py::test_engine_logprobs_equal_a_no_cache_forward[llama-processed]",
                             "test_logprobs.py::test_padded_scheduler_and_speculation_pause"),
     "the paged Llama's log-probabilities in the processed mode by default (the packed step, the decode chunk, "
     "greedy and sampled rows, top-k and top-p, a request asking none); the raw mode, every other family (the "
     "hybrid caches' packed and decode paths), the padded scheduler and a speculating engine in long (about "
     "4 minutes together)"),
    ("long", "other cases", ("test_logprobs.py::test_prompt_logprobs_equal_a_no_cache_forward",
                             "!test_logprobs.py::test_prompt_logprobs_equal_a_no_cache_forward[llama]"),
     "the paged Llama's prompt scoring by default (pieces, a prefix twin); every other family's packed step "
     "(the hybrid caches' and window models' logits) in long"),
    ("long", "other cases", ("test_parallel_sampling.py::test_n_siblings_share_one_prefill[qwen3_next/small]",
                             "test_parallel_sampling.py::test_n_siblings_share_one_prefill[dsv3/small]",
                             "test_parallel_sampling.py::test_hybrid_siblings_share_a_short_prompt_and_run_without_"
                             "the_prefix_cache"),
     "the paged Llama's siblings by default (forks, the prefix cache off, a short prompt, an aborted first); "
     "DeepSeek-V3's MLA pool and a hybrid cache's token-grain sharing in long"),
    ("long", "other cases", ("test_penalties.py::test_engine_penalties_equal_numpy_over_a_no_cache_forward",
                             "!test_penalties.py::test_engine_penalties_equal_numpy_over_a_no_cache_forward[llama]"),
     "the paged Llama's penalties by default (the packed step, the decode loop's own counts); the hybrid caches' "
     "paths (Qwen3-Next, Gemma 3) in long"),
    ("long", "other cases", ("test_speculative.py::test_engine_speculates_with_generate_tokens_under_preemption_"
                             "and_prefix_hits[early_exit]",),
     "the early exit's shared-pool drafting and rollback run by default in the paged rollback check; the engine "
     "with it (preemption, prefix hits) in long, with its other engine tests"),
    ("long", "program", ("test_logprobs.py::test_smollm2_logprobs_and_penalties_equal_a_no_cache_forward",),
     "the real SmolLM2 (30 layers) compiled with logprobs and penalties; random models and fixtures check the "
     "same paths by default"),
    ("long", "other cases", ("test_grammar.py::test_engine_grammar_rows_beside_plain_rows[padded]",
                             "test_grammar.py::test_engine_grammar_rows_beside_plain_rows[speculative]",
                             "test_grammar.py::test_engine_grammar_rows_beside_plain_rows[gemma3]"),
     "grammar rows in the packed scheduler by default (the paged Llama); the padded scheduler, a speculating "
     "engine (paused while a grammar row runs) and a hybrid cache (Gemma 3) in long"),
    ("long", "program", ("test_gemma3_gguf.py::*",),
     "the real Gemma 3 270M (a 262,144-token head on 2 cores: loading and compiling cost about 40 s before a "
     "token; its 262,144-token tokenizer about 15 s) on prompts of 6 to 1,508 tokens; the tiny gemma3 GGUF "
     "against transformers' loader (test_gguf.py) checks the model path by default, and the default pass "
     "measured 14:02 with only the tokenizer test left in it"),
    ("long", "program", ("test_structured.py::test_smollm2_follows_random_schemas_and_json_mode",),
     "the real SmolLM2 (30 layers) and JSON mode's index over its 49,152 tokens (about 19 s); a random model "
     "under random schemas checks the same paths by default"),
    ("long", "program", ("test_speculative.py::test_smollm2_speculates_with_its_own_first_layers",),
     "the real SmolLM2 (30 layers) compiled three times; random models check the same paths by default"),
    ("long", "other cases", ("test_nn_gemma3.py::test_cached_steps_equal_no_cache_recompute[paged]",
                             "test_window_cache.py::test_interleaved_cache_matches_float64_attention[paged]"),
     "the ring layout by default; gpt-oss's model tests check the paged one"),
    ("long", "other cases", ("test_nn_deepseek_v4.py::test_greedy_tokens_equal_transformers",
                             "test_nn_deepseek_v4.py::test_fp8_entries_bound",
                             "test_nn_qwen3_next_dsv3.py::test_dsv3_pool_dtype_bounds"),
     "schedules and pool formats beyond the default ones: DeepSeek-V4's ``small`` meets transformers by "
     "default (test_chunked_prefill_crosses_ring_compression_and_block_boundaries), DeepSeek-V3's fp8 pool "
     "in test_dsv3_fp8_pool_decode_equals_fp8_recompute"),

    ("long", "program", ("test_demo.py::*", "!test_demo.py::test_random_flag_serves_the_random_model"),
     "the demo's runs; by default test_gguf checks SmolLM2's tokens and test_random_flag the demo's dispatch"),
    ("long", "program", ("test_bench_smoke.py::test_scaling_mesh_runs_every_device_count_and_two_processes",),
     "subprocesses on 1, 2 and 4 devices and two jax.distributed processes, ~1.5 min"),
    ("long", "program", ("test_bench_isolation.py::test_scrub_cost_tables",
                         "test_bench_isolation.py::test_salted_tenants_are_at_chance_through_the_http_server"),
     "~1 min each; scrub-on-free is tested by default in test_tenants"),
    ("long", "program", ("test_server.py::test_503_while_starting_then_second_start_is_faster",
                         "test_server.py::test_bench_serve_http_quick",
                         "test_server.py::test_smollm2_greedy_chat_equals_transformers"),
     "server processes and the HTTP load bench; the server's other tests run by default, test_gguf checks "
     "SmolLM2's tokens through generate"),
    ("long", "program", ("test_mesh.py::test_a_speculating_engine_on_a_mesh",),
     "a subprocess with eight CPU devices per case (about a minute each); the engine's speculation runs on one "
     "device by default"),
    ("long", "program", ("test_mesh.py::test_two_processes",),
     "two jax.distributed processes; one process on eight devices runs by default"),
    ("long", "program", ("test_heads_mesh.py::test_pallas_kernels_on_a_mesh_give_one_devices_tokens",),
     "eight-device subprocesses through interpret-mode Pallas kernels (~1-2 min each); the head placement is "
     "checked by default, and every family's mesh tokens through test_mesh"),

    ("long", "fuzz", ("test_fuzz_engine_hybrid.py::*",),
     "the hybrid engines against generate (about 17 s a case); the default pass fuzzes the paged engine "
     "(test_fuzz_engine) and the hybrid manager (test_fuzz_hybrid)"),
    ("long", "fuzz", ("test_fuzz_host_paths.py::TestWindowMachine::*",
                      "test_fuzz_host_paths.py::TestSnapshotMachine::*"),
     "the window and snapshot host-path machines; the prefix-pin machine runs by default"),

    ("long", "second route", ("test_engine_families.py::test_hybrid_engine_preempts_by_swap_and_gives_"
                              "transformers_tokens",),
     "test_hybrid_host checks that swapped rows decode as if never swapped"),
    ("long", "second route", ("test_engine_families.py::test_windowed_requests_longer_than_the_pool_run_in_"
                              "window_memory",),
     "test_engine_admission admits such a request"),
    ("long", "second route", ("test_hybrid_prefix_tiers.py::test_three_host_hits_in_one_admission_with_one_"
                              "snapshot_row",),
     "more host-tier hits in one admission"),
    ("long", "second route", ("test_nn_deepseek_v4.py::test_fp8_cache_decode_equals_fp8_recompute",
                              "test_nn_qwen3_next_dsv3.py::test_dsv3_forks_like_llama",
                              "test_nn_gemma3.py::test_fp8_pages_and_exact_rings_keep_transformers_tokens",
                              "test_nn_gemma3.py::test_bfloat16_stays_near_float32"),
     "formats and forks of a family beyond its default tests (gpt-oss's bf16 test runs by default)"),
    ("long", "second route", ("test_packed_hybrid.py::test_dsv4_packed_steps_equal_unpacked_steps",),
     "Qwen3-Next's packed steps run by default"),
    ("long", "second route", ("test_scan_layers.py::test_a_scanned_qwen3_next_serves_as_the_unrolled_one",),
     "the scanned Qwen3-Next's cached steps and generate meet the unrolled model's by default; this adds the "
     "engine's packed step (~3 min on 2 cores)"),
    ("long", "second route", ("test_parallel_hybrid.py::test_beam_search_matches_brute_force",),
     "the sampled forks of the same families run by default"),
    ("long", "second route", ("test_tenants.py::test_scrub_zeroes_blocks_a_sliding_window_trims",
                              "test_tenants.py::test_snapshot_quota_keeps_a_tenant_hitting_while_another_floods"),
     "the paged scrub and the paged flood run by default; these add the window trim and the snapshot quota"),
    ("long", "second route", ("test_inplace_hybrid.py::test_hybrid_cache_step_is_in_place",
                              "test_kernel_tables.py::test_tpu_ragged_reference_decode",
                              "test_gguf.py::test_smollm2_config"),
     "the pieces are checked by default (each in-place write, the table exports, SmolLM2's tokens)"),

    # Moved on 2026-11-29, when CI's VM ran the default pass in 25:42 (about 2.2x slower than the VMs of the
    # sessions before): about 700 s of 2-core test time (docs/testing.md has the measured table).
    ("long", "program", ("test_bench_isolation.py::test_salted_tenants_are_at_chance_and_a_shared_salt_leaks",
                         "test_bench_real_scale.py::test_tiny_run_reports_every_section",
                         "test_bench_real_scale.py::test_tiny_decode_tokens_are_generate_greedy_tokens",
                         "test_bench_real_scale.py::test_a_split_decode_is_reported_in_the_json",
                         "test_bench_real_scale.py::test_packed_serving_at_the_engines_own_defaults_compiles_"
                         "nothing_timed",
                         "test_bench_host_overhead.py::test_host_overhead_table_has_every_row_and_column",
                         "test_bench_deployment.py::test_llama_70b_by_hand",
                         "test_bench_smoke.py::test_benchmark_runs_and_prints_json[*]"),
     "every benchmark run end to end (5-40 s each; ``serve`` ~55 s, ``spec`` ~1.5 min); what they measure "
     "is tested by default in the modules they drive (tenant isolation in test_tenants and test_isolation, "
     "the engine's packed step and its tokens, the host paths)"),
    ("long", "program", ("test_examples.py::test_example_runs[*]",),
     "every example as a subprocess (8-15 s each); what each shows is tested by default in the library's own "
     "tests"),
    ("long", "second route", ("test_scan_dsv4.py::test_a_scanned_deepseek_v4_is_the_unrolled_one",
                              "test_scan_layers.py::test_a_scanned_deepseek_v3_keeps_its_dense_head"),
     "whole scanned models against unrolled ones (20-45 s each); by default the scanned Qwen3-Next fixture "
     "meets transformers"),
    ("long", "second route", ("test_engine_families.py::test_gated_deltanet_prefill_lanes_hold_at_most_the_budget",
                              "test_engine_faults.py::test_hybrid_faults_touch_no_other_request",
                              "test_tenants.py::test_scrub_reaches_the_host_tiers",
                              "test_tenants.py::test_hybrid_scrub_leaves_no_byte_of_finished_requests[*]",
                              "test_speculative.py::test_a_speculating_engine_swaps_aborts_and_keeps_tenants_apart"
                              "[ngram]",
                              "test_structured.py::test_constraints_arriving_beside_a_speculating_request",
                              "test_engine_admission.py::test_the_fit_rule_and_generate_agree[12-3-True]",
                              "test_engine_sizing.py::test_engine_with_no_sizing_argument_serves_every_family"
                              "[dsv3/small]",
                              "test_engine_online.py::test_hybrid_engine_streams_and_aborts_give_back_every_block_"
                              "and_slot",
                              "test_tenants.py::test_prefix_quota_keeps_a_tenant_hitting_while_another_floods",
                              "test_nn_deepseek_v4.py::test_too_few_blocks_raise_oom_naming_the_group",
                              "test_nn_deepseek_v4.py::test_eos_stops_a_row_and_frees_its_blocks",
                              "test_nn_deepseek_v4.py::test_cached_equals_no_cache_recompute_lossless_chunks",
                              "test_scan_dsv4.py::*",
                              "test_paged_host_tier.py::*",
                              "test_speculative.py::test_packed_steps_verify_drafts_beside_prompt_pieces",
                              "test_nn_engine.py::test_seeded_requests_sample_what_generate_samples[swap]",
                              "test_tenants.py::test_paged_scrub_leaves_no_byte_of_finished_requests[True]"),
     "Qwen3-Next engine runs and second cases of paged ones (15-35 s each); by default the same rule runs on "
     "the Llama engine (fault containment, scrub-on-free, flooding tenants, speculation's own checks, "
     "constraints, the fit rule, streaming and aborts), the paged engine's fuzz, Qwen3-Next's packed steps and "
     "swaps in test_packed_hybrid and test_hybrid_host, gpt-oss's engine tokens under preemption, the "
     "scanned Qwen3-Next fixture, DeepSeek-V4's chunked prefill against transformers, the host tier's state "
     "machine (test_prefix_property's TestPrefixSchedulerHostTier) and the engine's speculation under "
     "preemption and prefix hits. Also here: all of test_scan_dsv4 and test_paged_host_tier, DeepSeek-V4's "
     "eos and lossless-chunk runs, the packed verify lane, a swap case and the scrub's second case"),

    ("aot", "compile without a GPU", ("test_kernels_aot.py::*", "*::test_aot_*"),
     "kernels compiled for H100/A100 through XLA's GPU pipeline; they skip without the CUDA plugin"),
)


# ============================================================================ a share of the long pass
#
# The whole ``long`` pass takes about 75 minutes on a 2-core VM of the slower kind CI ran on (2026-11-29),
# past what CI allows beside the default and ``aot`` passes (90 minutes in all). With JAXKV_LONG_SHARE=f
# (``.ci/run`` sets 0.5), each ``long`` test runs with probability f, drawn from a hash of its node id and
# the draw's name: JAXKV_LONG_DRAW if set, else the checked-out commit. The same commit runs the same tests
# (a failure reproduces), and every commit draws anew, so each test runs in about half of CI's runs; a
# line at the end of pytest's output says which draw ran. Without the variable (or f >= 1) every ``long``
# test runs.
#
# A share bounds the count, not the time: CI's VMs vary 3x in speed by the hour, and on 2026-12-02 CI's
# half (162 tests) ran past its 90 minutes (88% done after an hour). So JAXKV_LONG_BUDGET_S=s (``.ci/run``
# sets one) bounds the time: a ``long`` test that would start more than s seconds after its worker's
# session began skips, saying so; the summary line counts them. Under a share, the drawn tests run module
# by module in an order drawn from the same hash, so the modules a budget cuts differ from commit to commit.


def _long_share() -> float:
    return float(os.environ.get("JAXKV_LONG_SHARE", "1"))


def _long_draw_name() -> str:
    if os.environ.get("JAXKV_LONG_DRAW"):
        return os.environ["JAXKV_LONG_DRAW"]
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(__file__), capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no-git"


def _draw_point(draw: str, name: str) -> float:
    """A point in [0, 1) drawn from a hash of the draw's name and ``name``."""
    import hashlib

    digest = hashlib.sha256(f"{draw}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _drawn_into_the_share(nodeid: str, draw: str, share: float) -> bool:
    return _draw_point(draw, nodeid) < share


def _long_budget() -> float | None:
    text = os.environ.get("JAXKV_LONG_BUDGET_S")
    return float(text) if text else None


_SESSION_START = [time.monotonic()]
BUDGET_SPENT = "the long pass's time budget"


def pytest_sessionstart(session):
    _SESSION_START[0] = time.monotonic()


def pytest_runtest_setup(item):
    """Skips a ``long`` test once JAXKV_LONG_BUDGET_S is spent (see above)."""
    budget = _long_budget()
    if budget is None or "long" not in item.keywords:
        return
    spent = time.monotonic() - _SESSION_START[0]
    if spent > budget:
        pytest.skip(f"{BUDGET_SPENT} (JAXKV_LONG_BUDGET_S={budget:g}) was spent: {spent:.0f} s since this "
                    f"worker's session began; another commit's draw runs it, or run it alone")


def pytest_terminal_summary(terminalreporter):
    """Says which share of the ``long`` tests ran, and how many a time
    budget skipped (also under ``-q``)."""
    if _long_share() < 1:
        terminalreporter.write_line(f"long tests drawn: a share of {_long_share():g}, draw {_long_draw_name()} "
                                    "(JAXKV_LONG_SHARE, JAXKV_LONG_DRAW; tests/conftest.py)")
    if _long_budget() is not None:
        cut = [r for r in terminalreporter.stats.get("skipped", [])
               if BUDGET_SPENT in str(getattr(r, "longrepr", ""))]
        terminalreporter.write_line(f"long tests skipped by the time budget of {_long_budget():g} s "
                                    f"(JAXKV_LONG_BUDGET_S): {len(cut)}")


class _Row:
    """A row of RULES: its mark and whether it takes an item; each pattern
    counts the items it matched (a pattern that matches none is stale)."""

    def __init__(self, mark, tests):
        self.mark, self.test = mark, tests if callable(tests) else None
        patterns = () if callable(tests) else tests
        self.take = [_Pattern(p) for p in patterns if not p.startswith("!")]
        self.back = [_Pattern(p[1:]) for p in patterns if p.startswith("!")]

    def __call__(self, item) -> bool:
        if self.test is not None:
            return self.test(item)
        took = [p for p in self.take if p(item)]  # every pattern sees every item: each counts its own
        return bool(took) and not [p for p in self.back if p(item)]


class _Pattern:
    """A node-id pattern of RULES (see above), counting what it matched."""

    def __init__(self, text):
        self.text, self.case, self.hits = text, "[" in text, 0
        self.module = text.split("::")[0]
        self.rx = re.compile(".*".join(map(re.escape, text.split("*"))))

    def __call__(self, item) -> bool:
        full = item.nodeid.removeprefix("tests/")
        hit = bool(self.rx.fullmatch(full if self.case else full.split("[", 1)[0]))
        self.hits += hit
        return hit


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks from RULES first (``-m`` deselects after this hook), then:
    ``gpu`` tests need a GPU JAX can run on; ``aot`` tests need the CUDA
    plugin (``pip install 'jax[cuda12]>=0.10,<0.11'``), no GPU. Without
    them, they skip and say why."""
    import jax

    rows = [_Row(mark, tests) for mark, _, tests, _ in RULES]
    for item in items:
        for mark in sorted({row.mark for row in rows if row(item)}):
            item.add_marker(mark)
    # A pattern that names a collected module but matches none of its tests is stale (a test renamed or
    # gone): say so, unless only some tests were asked for (``path::name`` arguments).
    collected = {item.path.name for item in items}
    if not any("::" in arg for arg in config.args):
        stale = [p.text for row in rows for p in row.take + row.back if p.module in collected and not p.hits]
        if stale:
            raise pytest.UsageError("tests/conftest.py: these patterns of RULES match no test: " + ", ".join(stale))

    share = _long_share()
    if share < 1:
        draw = _long_draw_name()
        left = [item for item in items if "long" in item.keywords
                and not _drawn_into_the_share(item.nodeid, draw, share)]
        if left:
            config.hook.pytest_deselected(items=left)
            out = set(map(id, left))
            items[:] = [item for item in items if id(item) not in out]
        # Modules in a drawn order, each module's tests kept together and in order (its fixtures are built
        # once per worker), so that a time budget cuts different modules under different draws.
        first = {}
        for i, item in enumerate(items):
            first.setdefault(item.path.name, i)
        items.sort(key=lambda item: (_draw_point(draw, item.path.name), first[item.path.name]))

    wants_gpu = any("gpu" in item.keywords for item in items)
    has_gpu = wants_gpu and jax.default_backend() == "gpu"
    has_plugin = _cuda_plugin()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(
                reason=f"compiled GPU kernel: JAX's backend here is {jax.default_backend()!r}, not a GPU"))
        if "aot" in item.keywords and not has_plugin:
            item.add_marker(pytest.mark.skip(
                reason="compile for H100 without a GPU: needs pip install 'jax[cuda12]>=0.10,<0.11' "
                       "(see docs/kernels.md)"))


def _memory_mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:  # not Linux: no such limit to watch
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs_near_the_map_limit():
    """The module-scoped release below is not enough for a module whose
    tests compile many programs each (the long pass's drawn parity
    configurations, the real SmolLM2 in several forms): CI's long pass lost
    a worker to a segfault in an XLA compile at 31%. A heavy engine test adds
    about 100 mappings a second (a worker of the long pass was seen at 31,170,
    2026-11-29), so after any test that leaves the worker above 20,000 (under
    a third of ``vm.max_map_count``'s default), drop the compiled programs at
    once rather than at the module's end."""
    yield
    if _memory_mappings() > 20_000:
        _drop_compiled_programs()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test module ends. Each XLA:CPU
    executable holds its own memory mappings (the 19 tests of two modules
    leave ~8,000), and a worker that runs hundreds of modules' programs
    passes Linux's default ``vm.max_map_count`` (65,530): LLVM's next
    allocation fails and the worker dies in a compile (segfault / abort).
    Cleared between modules, a worker stays near 1,000 mappings; the cost is
    recompiling the few programs two modules share (each module builds its
    own models and keeps them in module-level caches)."""
    yield
    _drop_compiled_programs()


def _drop_compiled_programs() -> None:
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
