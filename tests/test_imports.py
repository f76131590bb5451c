"""Layout rules, checked in fresh interpreters (this test process has both frameworks loaded):
``import logitless`` and the specs load no framework; the torch side never loads JAX; the
JAX side never loads torch."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "logitless"


def loaded_after(*snippets: str):
    """Run the code snippets in a fresh interpreter; return the top-level modules it has then."""
    code = "\n".join(textwrap.dedent(s) for s in snippets)
    probe = code + textwrap.dedent("""
        import json, sys
        print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"the probe failed:\n{code}\n{r.stderr}"
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def modules_in(*paths: str):
    """Dotted names of the logitless modules at ``paths`` (files or subpackages, relative to
    the package) that exist now; other engineers add modules as they go."""
    found = []
    for rel in paths:
        p = PKG / rel
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p] if p.exists() else []
        found += ["logitless." + ".".join(f.relative_to(PKG).with_suffix("").parts)
                  .replace(".__init__", "") for f in files]
    return found


def imports(mods):
    return "\n".join(f"import {m}" for m in mods)


def test_import_logitless_loads_no_framework():
    mods = loaded_after("import logitless")
    assert "logitless" in mods
    assert not mods & {"torch", "jax", "jaxlib", "triton"}, sorted(mods & {"torch", "jax", "triton"})


def test_specs_load_no_framework():
    specs = modules_in("specs")
    assert "logitless.specs.linear_cross_entropy" in specs and "logitless.specs.tiling" in specs
    mods = loaded_after(imports(specs))
    bad = mods & {"torch", "jax", "jaxlib", "triton"}
    assert not bad, f"{specs} pulled in {sorted(bad)}"


def test_torch_side_loads_no_jax():
    """logitless.torch, its chunked backend and every Triton kernel module, and a forward +
    backward on the default CPU backend, never import JAX."""
    side = modules_in("torch.py", "_torch_common.py", "torch_chunked.py", "triton_kernels")
    assert "logitless.torch" in side and "logitless.torch_chunked" in side
    mods = loaded_after(imports(side), """
        import torch
        import logitless.torch as lt
        x = torch.randn(5, 3, requires_grad=True)
        w = torch.randn(7, 3, requires_grad=True)
        lt.linear_cross_entropy(x, w, torch.tensor([0, 1, 6, -100, 2])).backward()
        lt.linear_cross_entropy(x, w, torch.tensor([0, 1, 6, -100, 2]), backend="torch",
                                label_smoothing=0.1, return_lse=True)[0].backward()
    """)
    assert "torch" in mods
    bad = mods & {"jax", "jaxlib"}
    assert not bad, f"the torch side imported {sorted(bad)}"


def test_jax_side_loads_no_torch():
    """logitless.jax, its XLA backend and every Pallas kernel module never import torch, nor
    does a jax.grad through the default (CPU) backend. The JAX side is being written: the
    check covers whatever of it exists, and fails only if something there imports torch."""
    side = modules_in("jax.py", "_jax_common.py", "xla_chunked.py", "pallas_kernels")
    run = ""
    if importlib.util.find_spec("logitless.jax") is not None:
        run = """
            import jax, jax.numpy as jnp
            import logitless.jax as lj
            x, w = jnp.ones((5, 3)), jnp.arange(21.0).reshape(7, 3) / 21
            loss = lambda x, w: lj.linear_cross_entropy(x, w, jnp.array([0, 1, 6, -100, 2]))
            jax.grad(loss, argnums=(0, 1))(x, w)
        """
    mods = loaded_after(imports(side), "import jax.numpy", run)
    assert "jax" in mods
    bad = mods & {"torch"}
    assert not bad, f"{side} imported {sorted(bad)}"


def test_keyword_errors_load_no_framework():
    """The front doors' shared keyword wording (logitless/_keywords.py) is framework-free."""
    mods = loaded_after("import logitless._keywords")
    assert not mods & {"torch", "jax", "jaxlib", "triton"}, sorted(mods & {"torch", "jax"})
