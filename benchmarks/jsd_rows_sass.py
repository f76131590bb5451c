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
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from logitless.triton_kernels import jsd_rows  # noqa: E402

WARPS = 4  # linear_jsd's GPU default, with BASE_VARIANT's BLOCK
LAUNCHES = [("JSD pass 1", dict(PHASE=1)), ("JSD pass 2", dict(PHASE=2)),
            ("JSD pass 3", dict(PHASE=3)), ("forward KL pass 1", dict(PHASE=1, KIND=0)),
            ("forward KL pass 3", dict(PHASE=3, KIND=0)),
            # fp16_tile_logits: fp16 logits beside per-tile offsets, Λ kept for pass 3
            ("JSD tiles pass 1", dict(PHASE=1, TILE_W=256)),
            ("JSD tiles pass 2", dict(PHASE=2, TILE_W=256)),
            ("JSD tiles pass 3", dict(PHASE=3, TILE_W=256))]


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
    per_thread = jsd_rows.BASE_VARIANT["BLOCK"] // (32 * WARPS)
    for label, over in LAUNCHES:
        v = dict(over)
        if v["PHASE"] != 3:  # what the launcher passes to the passes before the last (pass
            # 2 with tiles keeps Λ for the gradient: WRITE_GRAD)
            v.update(WRITE_GRAD=v["PHASE"] == 2 and v.get("TILE_W", 0) > 0, WRITE_LOSS=False)
        try:
            _, sass = jsd_rows.compile_sass(v, num_warps=WARPS, kernel=mod.jsd_rows_kernel)
        except ValueError as e:  # a variant an older kernel file does not have
            print(f"{label}: n/a ({e})")
            continue
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
