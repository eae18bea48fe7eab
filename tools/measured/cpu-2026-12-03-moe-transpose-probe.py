"""Deviceless H100 compile of the routed-experts MLP (jaxkv.nn.layers' _routed, in row chunks) at
DeepSeek-V4-Flash-like's local expert shapes on tp=8 (32 experts, hidden 4096, intermediate 2048, top-6):
the expert weights transposed inside the program (swapaxes, as _routed does) or contracted in place
(ragged_dot_general). Prints the temporaries and writes the HLO to /tmp/moe_<variant>_<tokens>.hlo.

    pip install "jax[cuda12]>=0.10,<0.11"
    JAX_PLATFORMS=cpu python tools/measured/cpu-2026-12-03-moe-transpose-probe.py <tokens> swap|general
"""
import sys, re
import jax, jax.numpy as jnp
from jaxkv.nn.layers import in_row_chunks, rows_per_chunk, _swiglu
from jaxkv.bench.engine_aot import compile_for_h100
from kernels_pallas import aot_check

T, K, G, H, I = int(sys.argv[1]), 6, 32, 4096, 2048
variant = sys.argv[2]
dev = aot_check.topology_device("h100")
sh = jax.sharding.SingleDeviceSharding(dev)
S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)

DN = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                       rhs_group_dimensions=[0])

@jax.jit
def routed(x, experts, weights, gate_up_proj, down_proj):
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // K
    sizes = jnp.bincount(flat, length=G).astype(jnp.int32)
    def mlp(rows, sizes):
        if variant == "swap":
            gate_up = jax.lax.ragged_dot(rows, jnp.swapaxes(gate_up_proj, 1, 2).astype(x.dtype), sizes)
        else:
            gate_up = jax.lax.ragged_dot_general(rows, gate_up_proj, sizes, DN)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        h = _swiglu(gate, up, None)
        if variant == "swap":
            return jax.lax.ragged_dot(h, jnp.swapaxes(down_proj, 1, 2).astype(x.dtype), sizes)
        return jax.lax.ragged_dot_general(h, down_proj, sizes, DN)
    width = max(gate_up_proj.shape[2], down_proj.shape[2])
    out = in_row_chunks(mlp, x[token], sizes, rows_per_chunk(G, width))
    out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
    return jnp.zeros_like(x).at[token].add(out)

args = (S((T, H), jnp.bfloat16), S((T, K), jnp.int32), S((T, K), jnp.float32), S((G, 2 * I, H), jnp.bfloat16),
        S((G, H, I), jnp.bfloat16))
c = compile_for_h100(routed, args, {})
m = c.memory_analysis()
hlo = c.as_text()
open(f"/tmp/moe_{variant}_{T}.hlo","w").write(hlo)
print(variant, T, "chunk", rows_per_chunk(G, H), "temp GB", round(m.temp_size_in_bytes / 1e9, 3),
      "transposes of [32,..]:", len(re.findall(r"bf16\[32,\d+,\d+\]\{[^}]*\} (?:transpose|fusion|copy)", hlo)))
