import sys
from jaxkv.bench import engine_aot
from jaxkv.serve import program_memory
fixed = program_memory.ProgramMemory((("packed[256]", int(2.43e9)), ("decode chunk x16", int(2.27e9))), 0.0)
program_memory.measure = lambda programs, compile_program=None: fixed
spec = next(s for s in engine_aot.MODELS if s.name == "DeepSeek-V4-Flash-like")
setup = engine_aot.build(spec)
print(engine_aot._describe(setup), flush=True)
for label, fn, args, kwargs in engine_aot.programs(setup, sys.argv[1].split(",")):
    r = engine_aot.compile_program(setup, label, fn, args, kwargs)
    print(label, f"{r.seconds:.0f} s temp GB {r.temp_bytes/1e9:.3f} cache GB {r.cache_bytes/1e9:.3f} peak {r.peak_bytes/1e9:.1f}", r.verdict, flush=True)
    for line in (r.cache_buffers or r.largest)[:4]:
        print("   ", line[:250])
