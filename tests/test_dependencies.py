"""Dependencies where they are used (issue 40 item 4): importing jaxkv, its
models, its allocator and its engine never imports the server's packages
(fastapi, uvicorn, prometheus_client; the ``serve`` extra) or the text
packages (tokenizers, jinja2, gguf; the ``text`` extra), so
``pip install jaxkv`` alone serves the library; each extra is declared in
``pyproject.toml`` and a missing one is named in the error."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONAL = {"serve": ("fastapi", "uvicorn", "prometheus_client"), "text": ("tokenizers", "jinja2", "gguf")}


def test_the_library_imports_no_optional_package():
    code = ("import sys, jaxkv, jaxkv.nn, jaxkv.serve, jaxkv.serve.engine, jaxkv.text, jaxkv.nn.gguf, jaxkv.demo; "
            f"print(sorted(m for m in {sum(OPTIONAL.values(), ())!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_demo_needs_no_server_package():
    """The README's first command installs the ``text`` extra only: the
    demo's own imports (its compile-cache setup included) must not need
    fastapi and the other server packages (they are blocked here)."""
    code = ("import sys\nfor m in ('fastapi', 'uvicorn', 'prometheus_client', 'starlette'):\n    sys.modules[m] = None\n"
            "import jaxkv.demo\nfrom jaxkv.serve.compile_cache import configure_compile_cache, default_compile_cache_dir\n"
            "print(default_compile_cache_dir() != '')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stdout + out.stderr
    with open(os.path.join(ROOT, "jaxkv", "demo.py"), encoding="utf-8") as f:
        assert "jaxkv.serve.http" not in f.read(), "the demo imports the HTTP server's module"


def test_the_extras_declare_them():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    required = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    for extra, packages in OPTIONAL.items():
        for package in packages:
            assert package not in required, f"{package} is a core dependency"
            assert any(dep.startswith(package) for dep in extras[extra]), (extra, package)
    assert "jaxkv[text]" in extras["serve"] and "jaxkv[serve,text]" in extras["dev"]


def test_a_missing_text_package_is_named_with_its_extra():
    # tokenizers hidden: the tokenizer's constructor says which extra brings it.
    code = ("import sys; sys.modules['tokenizers'] = None; import importlib.util; "
            "importlib.util.find_spec = (lambda f: (lambda name, *a: None if name == 'tokenizers' else f(name, *a)))"
            "(importlib.util.find_spec); "
            "from jaxkv.text import Tokenizer\n"
            "try:\n    Tokenizer.from_pretrained('.')\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "pip install 'jaxkv[text]'" in out.stdout and "tokenizers" in out.stdout, out.stdout + out.stderr
