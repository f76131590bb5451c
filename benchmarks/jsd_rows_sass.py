"""Instructions per element of the JSD row kernel's column loops, from its SASS, on a CPU.

Compiles ``jsd_rows_kernel`` for sm_90 (no GPU needed: Triton's compiler and the bundled
ptxas / cuobjdump), finds the innermost loops of each launch's SASS and prints the largest
(the pass's column loop, one block per iteration) divided by the elements a thread handles
per iteration (BLOCK / (32 · warps)), with the MUFU (exp2 / lg2) count; the other loops
(pass 3's zero fill of an ignored row, unrolled by ptxas) as raw instruction counts. Pass a file to count another version of the kernel (an A/B of code:
``git show <commit>:logitless/triton_kernels/jsd_rows.py > /tmp/old.py``).

    PYTHONPATH=. python3 benchmarks/jsd_rows_sass.py [path/to/jsd_rows.py]
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from logitless.triton_kernels import jsd_rows  # noqa: E402

WARPS, BLOCK = 4, 1024  # linear_jsd's GPU defaults
LAUNCHES = [("JSD pass 1", dict(PHASE=1)), ("JSD pass 2", dict(PHASE=2)),
            ("JSD pass 3", dict(PHASE=3)), ("forward KL pass 1", dict(PHASE=1, KIND=0)),
            ("forward KL pass 3", dict(PHASE=3, KIND=0))]


def _module(path):
    if not path:
        return jsd_rows
    spec = importlib.util.spec_from_file_location("logitless.triton_kernels._sass_rows", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    mod = _module(sys.argv[1] if len(sys.argv) > 1 else None)
    sig = dict(s_ptr="*fp32", s_stride="i32", t_ptr="*fp32", t_stride="i32", dz_ptr="*bf16",
               dz_stride="i32", y_ptr="*i64", g_ptr="*fp32", g_stride="i32", loss_ptr="*fp32",
               part_ptr="*fp32", sync_ptr="*i32", n_rows="i32", V="i32", V_LOAD="i32",
               ignore_index="i32", inv_t="fp32", beta="fp32", omb="fp32", hard_w="fp32")
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if (n.endswith("_ptr") or n.endswith("_stride") or n in ("V", "V_LOAD"))
             and n != "g_stride"}
    base = dict(KIND=2, HAS_Y=True, HARD=False, T_ONE=True, WRITE_LOSS=True, WRITE_GRAD=True,
                SEGS=16, SEGS_P2=16, SEG=8192, BLOCK=BLOCK, ROUND_BF16=False,
                MAX_SPIN=1 << 20, FORM=0, STAGES=1)
    per_thread = BLOCK // (32 * WARPS)
    ptxas, cuobjdump = mod._cuda_tool("ptxas", 90), mod._cuda_tool("cuobjdump", 90)
    for label, over in LAUNCHES:
        cons = {**base, **over}
        if cons["PHASE"] != 3:  # what the launcher passes to the passes before the last
            cons.update(WRITE_GRAD=False, WRITE_LOSS=False)
        src = ASTSource(fn=mod.jsd_rows_kernel, constexprs=cons, attrs=attrs,
                        signature={**sig, **{k: "constexpr" for k in cons}})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": WARPS})
        with tempfile.TemporaryDirectory() as d:
            Path(d, "k.ptx").write_text(compiled.asm["ptx"])
            subprocess.run([ptxas, "-arch=sm_90a", os.path.join(d, "k.ptx"), "-o",
                            os.path.join(d, "k.cubin")], check=True)
            sass = subprocess.run([cuobjdump, "-sass", os.path.join(d, "k.cubin")],
                                  capture_output=True, text=True, check=True).stdout
        code, inner = jsd_rows.sass_loops(sass)
        loops = sorted(([t for addr, t in code if a <= addr <= b] for a, b in inner), key=len,
                       reverse=True)
        col = loops[0]  # the pass's column loop: one block per iteration, not unrolled
        others = ", ".join(str(len(b)) for b in loops[1:])
        print(f"{label}: {len(col) / per_thread:.1f} instructions/element "
              f"({sum('MUFU' in t for t in col) / per_thread:.2f} MUFU)"
              + (f"; other innermost loops (an ignored row's zero fill, unrolled): {others} "
                 "instructions" if others else ""))


if __name__ == "__main__":
    main()
