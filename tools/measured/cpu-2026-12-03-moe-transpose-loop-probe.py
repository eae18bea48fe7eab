"""jaxkv.nn.layers.Experts._routed itself (the local-experts path: row chunks under lax.map) compiled for a
deviceless H100 at DeepSeek-V4-Flash-like's local expert shapes on tp=8 (32 experts, hidden 4096,
intermediate 2048, top-6): its temporaries, and how many weight transposes sit in a loop body.

    pip install "jax[cuda12]>=0.10,<0.11"
    JAX_PLATFORMS=cpu python tools/measured/cpu-2026-12-03-moe-transpose-loop-probe.py <tokens>
"""
import sys, re
import jax, jax.numpy as jnp
from flax import nnx
from jaxkv.nn.layers import Experts
from jaxkv.bench.engine_aot import compile_for_h100
from kernels_pallas import aot_check
T, K, G, H, I = int(sys.argv[1]), 6, 32, 4096, 2048
dev = aot_check.topology_device("h100"); sh = jax.sharding.SingleDeviceSharding(dev)
S = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
ex = nnx.eval_shape(lambda: Experts(G, H, I, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
@jax.jit
def f(x, experts, weights, gu, dn, local):
    return ex._routed(x, experts, weights, gu, dn, local)
args = (S((T, H), jnp.bfloat16), S((T, K), jnp.int32), S((T, K), jnp.float32), S((G, 2 * I, H), jnp.bfloat16),
        S((G, H, I), jnp.bfloat16), S((T, K), jnp.bool_))
c = compile_for_h100(f, args, {})
hlo = c.as_text()
bodies = re.split(r"\n(?=%\S+ \()", hlo)
loop_tr = sum(1 for b in bodies if "get-tuple-element" in b and re.search(r"bf16\[32,\d+,\d+\]\{[^}]*\} fusion\([^)]*\), kind=kInput, calls=%wrapped_transpose", b) and "arg_tuple" in b.split("\n")[0])
print(T, "temp GB", round(c.memory_analysis().temp_size_in_bytes / 1e9, 3), "transposes in a loop body:", loop_tr,
      "transposes in all:", len(re.findall(r"calls=%wrapped_transpose", hlo)))
