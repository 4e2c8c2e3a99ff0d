"""images/completions/Dockerfile (docker cannot run here): it installs exactly the pins of
images/completions/requirements.txt, which are complete (every dependency of every pin, for the
extras it asks for, is pinned too) and equal to what the tests run the service with, and copies
only the service's package: no loader, a non-root user."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "images" / "completions"
DOCKERFILE = (IMAGE / "Dockerfile").read_text()


def pins() -> dict[str, Requirement]:
    lines = (IMAGE / "requirements.txt").read_text().splitlines()
    reqs = [Requirement(x) for x in lines if x.strip() and not x.startswith("#")]
    return {canonicalize_name(r.name): r for r in reqs}


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [
        (line.split()[0].upper(), line.split(None, 1)[1])
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_every_pin_is_exact_and_is_what_the_tests_run():
    for name, req in pins().items():
        (spec,) = req.specifier
        assert spec.operator == "==", f"{name}: pin it with =="
        assert importlib.metadata.version(name) == spec.version, (
            f"{name}: the image pins {spec.version}, the tests run "
            f"{importlib.metadata.version(name)}"
        )


def test_the_development_pins_are_the_images():
    """requirements.txt and requirements-dev.txt pin every package of the image to the same
    version, so a fresh `make install` tests what the image runs."""
    dev: dict[str, str] = {}
    for name in ("requirements.txt", "requirements-dev.txt"):
        for line in (ROOT / name).read_text().splitlines():
            if line.strip() and not line.startswith(("#", "-")):
                req = Requirement(line)
                dev[canonicalize_name(req.name)] = next(iter(req.specifier)).version
    differ = {
        name: (next(iter(req.specifier)).version, dev.get(name))
        for name, req in pins().items()
        if dev.get(name) != next(iter(req.specifier)).version
    }
    assert not differ, f"image pin, development pin: {differ}"


def test_the_pins_are_complete():
    """pip installs them with --no-deps: every dependency of a pin (with the extras asked
    for) must be pinned too, else the image would lack it."""
    pinned = pins()
    missing = []
    for name, req in pinned.items():
        for dep in importlib.metadata.requires(name) or []:
            dependency = Requirement(dep)
            extras = req.extras or {""}
            if dependency.marker and not any(
                dependency.marker.evaluate({"extra": e, "python_version": "3.11"}) for e in extras
            ):
                continue
            if canonicalize_name(dependency.name) not in pinned:
                missing.append(f"{name} needs {dependency}")
    assert not missing


def test_the_service_s_own_imports_are_pinned():
    wanted = {"starlette", "uvicorn", "prometheus-client", "tritonclient", "grpcio", "numpy"}
    assert wanted <= set(pins())
    assert "grpc" in pins()["tritonclient"].extras


def test_the_dockerfile_installs_exactly_the_pins_and_copies_only_the_package():
    steps = instructions()
    runs = " ".join(arg for kind, arg in steps if kind == "RUN")
    installs = [x.split() for x in re.findall(r"pip install ([^&]+)", runs)]
    assert installs == [["--no-cache-dir", "--no-deps", "-r", "/tmp/completions-requirements.txt"]]
    assert "pip check" in runs
    copies = [arg.split() for kind, arg in steps if kind == "COPY"]
    assert copies == [
        ["images/completions/requirements.txt", "/tmp/completions-requirements.txt"],
        ["completions_service", "/app/completions_service"],
    ]
    assert not [arg for _, arg in steps if "loader" in arg]
    user = next(arg for kind, arg in steps if kind == "USER")
    assert user.split(":")[0].isdigit() and user.split(":")[0] != "0"
    assert dict(steps)["ENTRYPOINT"] == '["completions-service"]'


def test_the_console_script_the_chart_runs_is_made_like_pips(tmp_path):
    """The chart's command is `completions-service`: the image writes it as pip's console
    script would (pyproject's [project.scripts]), and it runs the service's main."""
    import subprocess
    import sys
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["completions-service"] == "completions_service.cli:main"
    written = re.search(
        r"printf '([^']+)'\s*\\?\s*>\s*/usr/local/bin/completions-service", DOCKERFILE
    )
    assert written, "the Dockerfile writes no /usr/local/bin/completions-service"
    script = tmp_path / "completions-service"
    text = written[1].replace("\\n", "\n")
    script.write_text(text.replace("#!/usr/local/bin/python", f"#!{sys.executable}"))
    script.chmod(0o755)
    done = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, cwd=ROOT, check=False,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--triton-url" in done.stdout


def test_the_build_context_admits_only_the_package_and_its_pins():
    ignore = (IMAGE / "Dockerfile.dockerignore").read_text().split("\n")
    admitted = sorted(x for x in ignore if x.startswith("!"))
    assert ignore[ignore.index("*") :] and admitted == [
        "!completions_service/",
        "!images/completions/requirements.txt",
    ]
    root = (ROOT / ".dockerignore").read_text().split()
    assert {"!completions_service/", "!images/completions/requirements.txt"} <= set(root)
