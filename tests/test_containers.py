"""Lint of the Dockerfile, docker-compose.yml and .dockerignore (no Docker engine here: they are parsed).

Hadolint-style rules that matter for this project: pinned base images, a non-root ``USER`` and a
``HEALTHCHECK`` in the API stage, no torch in the API image, every ``COPY`` source present and not
ignored, compose services wired to the stages, the migrations and the settings names of ``app/config.py``.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass, field

import pytest
import yaml

from app.config import REPO_ROOT, Settings
from app.migrate import ALEMBIC_INI_ENV

#: ``LAYERCAST_*`` variables something reads: the settings fields and the alembic.ini override.
KNOWN_ENV = {f"LAYERCAST_{name.upper()}" for name in Settings.model_fields} | {ALEMBIC_INI_ENV}
#: ``name:tag`` with a numeric ``x.y.z`` (or ``x.y``) version in the tag, e.g. ``python:3.11.11-slim-bookworm``.
PINNED = re.compile(r"^[\w./-]+:\d+\.\d+(\.\d+)?([-.][\w.-]+)?(@sha256:[0-9a-f]{64})?$")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages of a Dockerfile: continuation lines joined, comments and parser directives dropped."""
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            current += line[:-1].rstrip() + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "dangling line continuation"
    stages: list[Stage] = []
    for line in logical:
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=parts[0], name=name))
        elif instruction == "ARG" and not stages:
            continue
        else:
            assert stages, f"{instruction} before FROM"
            stages[-1].instructions.append((instruction, args.strip()))
    return stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    parsed = parse_dockerfile((REPO_ROOT / "Dockerfile").read_text())
    assert all(s.name for s in parsed), "every stage is named"
    return {str(s.name): s for s in parsed}


@pytest.fixture(scope="module")
def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def _chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and every stage it builds on (``FROM <stage>``) or copies from (``COPY --from=<stage>``)."""
    seen: list[Stage] = []
    todo = [name]
    while todo:
        stage = stages[todo.pop()]
        if stage in seen:
            continue
        seen.append(stage)
        if stage.base in stages:
            todo.append(stage.base)
        for copy in stage.args("COPY"):
            match = re.search(r"--from=(\S+)", copy)
            if match and match.group(1) in stages:
                todo.append(match.group(1))
    return seen


def test_parser_reads_continuations_and_stages() -> None:
    parsed = parse_dockerfile("# c\nFROM a:1.2 AS x\nRUN a \\\n  # note\n  && b\nFROM x AS y\nUSER u\n")
    assert [(s.base, s.name) for s in parsed] == [("a:1.2", "x"), ("x", "y")]
    assert parsed[0].instructions == [("RUN", "a && b")]


def test_base_images_are_pinned(stages: dict[str, Stage]) -> None:
    external = [s.base for s in stages.values() if s.base not in stages]
    assert external
    for image in external:
        assert PINNED.match(image), f"base image {image!r} is not pinned to a version"
        assert not image.endswith(":latest")


def test_default_target_is_the_api_and_it_is_slim_non_root_and_healthchecked(stages: dict[str, Stage]) -> None:
    api = list(stages.values())[-1]
    assert api.name == "api", "`docker build .` must build the API image"
    assert "slim" in api.base
    users = api.args("USER")
    assert users and users[-1] not in ("root", "0", "0:0")
    names = [i for i, _ in api.instructions]
    assert names.index("USER") < names.index("CMD")
    (healthcheck,) = api.args("HEALTHCHECK")
    assert "/healthz" in healthcheck and "--interval=" in healthcheck
    assert "serve" in api.args("CMD")[-1]


def test_no_torch_in_the_api_image(stages: dict[str, Stage]) -> None:
    for stage in _chain(stages, "api"):
        for instruction, args in stage.instructions:
            assert "torch" not in args.lower(), f"{stage.name}: {instruction} {args}"
            assert not re.search(r"\[[^\]]*\btrain\b", args), f"{stage.name} installs the train extra"


def test_worker_image_has_torch_pinned_and_runs_the_worker(stages: dict[str, Stage]) -> None:
    runs = " ".join(a for s in _chain(stages, "worker") for a in s.args("RUN"))
    assert "torch==2.13.0" in runs and "whl/cpu" in runs
    assert stages["worker"].args("USER")[-1] not in ("root", "0")
    assert json.loads(stages["worker"].args("CMD")[-1]) == ["layercast", "worker"]


def _dockerignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path.rstrip("/"), p.rstrip("/")) for p in patterns)


def test_copy_sources_exist_and_are_not_dockerignored(stages: dict[str, Stage]) -> None:
    ignore = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    for required in (".git", ".venv", "var"):
        assert required in ignore, f".dockerignore misses {required}"
    for stage in stages.values():
        for copy in stage.args("COPY"):
            if "--from=" in copy:
                continue
            *sources, _dest = copy.split()
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"COPY {source}: missing"
                assert not _dockerignored(source, ignore), f"COPY {source}: excluded by .dockerignore"


def test_env_names_are_settings(stages: dict[str, Stage], compose: dict) -> None:  # type: ignore[type-arg]
    names: set[str] = set()
    for stage in stages.values():
        for env in stage.args("ENV"):
            names |= {pair.split("=", 1)[0] for pair in shlex.split(env)}
    for service in compose["services"].values():
        names |= set(service.get("environment") or {})
    layercast = {n for n in names if n.startswith("LAYERCAST_")}
    assert layercast, "no LAYERCAST_ variable set"
    assert layercast <= KNOWN_ENV, f"not read by app/config.py: {sorted(layercast - KNOWN_ENV)}"


def test_compose_services_stages_migrations_and_healthchecks(
    compose: dict, stages: dict[str, Stage]  # type: ignore[type-arg]
) -> None:
    services = compose["services"]
    assert {"db", "migrate", "api", "worker"} <= set(services)
    assert PINNED.match(services["db"]["image"])
    assert "pg_isready" in " ".join(services["db"]["healthcheck"]["test"])
    assert services["migrate"]["command"] == ["layercast", "migrate"]
    assert services["migrate"]["depends_on"]["db"]["condition"] == "service_healthy"
    for name in ("api", "worker"):
        assert services[name]["build"]["target"] in stages
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        url = services[name]["environment"]["LAYERCAST_DATABASE_URL"]
        assert url.startswith("postgresql+psycopg://") and "@db:5432/" in url
    assert services["api"]["build"]["target"] == "api" and services["worker"]["build"]["target"] == "worker"
    assert services["worker"]["command"] == ["layercast", "worker"]
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])
    assert any(p.endswith(":8000") for p in services["api"]["ports"])


def test_readme_describes_the_images() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert "docker compose up --build" in readme
    assert "--target worker" in readme


def test_healthcheck_paths_exist() -> None:
    from app.main import create_app

    paths = set(create_app().openapi()["paths"])
    assert {"/healthz", "/readyz", "/metrics"} <= paths

