"""Imports in the engine run downward only, checked from the source (``ast``, no import).

``LAYERS`` is the stack, written down once, top first: a module may import its own layer
and the layers below it, never one above. Every import counts, also one inside a function
or under ``TYPE_CHECKING``: a lazy upward import is still an upward dependency. Every
module under ``inference/`` and ``pagoda_kernels/`` must be in a layer, so a new module is placed
on purpose. Nor may imports within ``inference/`` run in a circle, not even type-only
ones inside one layer: a module that needs a name of the module importing it takes it as
an argument instead. ``inference/bench/`` may import anything (it measures the whole stack), and
only the ``pagoda`` command above it imports it. The operator stands apart: it imports
neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("inference", "pagoda_kernels")

# An entry names a module or a package (then everything in it, unless a longer entry
# names the module); "pkg.__init__" names a package's own __init__.py only.
# Layer 0 is the top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("inference.cli",),  # the `pagoda` command: serve, chat, bench, download
    ("inference.router",),  # `pagoda router`: HTTP in front of engines, never the engine itself
    ("inference.bench",),  # pagoda bench latency|throughput|serve
    ("inference.server",),  # the OpenAI-compatible HTTP API
    ("inference.async_engine",),  # the server's asyncio front of the engine process
    ("inference.engine_core", "inference.llm", "inference.__init__"),  # the engine's fronts
    ("inference.llm_engine",),  # the step loop
    # an engine from its config; default sampling parameters; chat templates
    ("inference.engine_setup", "inference.generation_defaults", "inference.chat_templates",
     "inference.reconfigure"),  # live setting changes: scheduler, KV cache, graphs
    ("inference.executor",),  # the ModelExecutor protocol; tensor-parallel workers
    ("inference.spec_decode.eagle",),  # an EAGLE head fed the target's hidden states
    ("inference.spec_decode.draft_model",),  # a draft model beside the target's runner
    ("inference.runner",),  # the model in this process: inputs, CUDA graphs, forward
    ("inference.lora",),  # LoRA adapters: files, device slots, the engine's registry
    ("inference.models",),  # model families, weight loading
    ("inference.quantization",),  # FP8 and int4 weights: their layouts, filled from a checkpoint
    ("inference.layers",),  # attention metadata, embedding, rotary
    # a step's bookkeeping: batching and KV blocks; what the sampled tokens mean for requests
    ("inference.scheduler", "inference.output_processor", "inference.spec_decode"),
    ("inference.block_manager",),
    # what a sampled row means: sampling, grammars, text
    ("inference.sampler", "inference.structured_output", "inference.detokenizer",
     "inference.text_output"),
    ("inference.spec_decode.rejection",),  # verifying drafts on the device
    ("inference.sequence",),
    ("inference.engine_messages",),  # engine process <-> server
    ("inference.config",),  # EngineConfig
    ("inference.spec_decode.config",),  # speculative_config, parsed
    # which quantization a checkpoint asks for (torch-free)
    ("inference.quantization.__init__", "inference.quantization.int4_config"),
    (  # what a model is and where it comes from
        "inference.models.config", "inference.model_files", "inference.model_shapes",
        "inference.download",
    ),
    # what a request asks and gets
    ("inference.sampling_params", "inference.outputs", "inference.lora.request"),
    ("inference.parallel_state",),  # process groups and collectives
    ("pagoda_kernels",),  # Triton kernels and their torch references
)
MAY_IMPORT_ANYTHING = ("inference.bench",)


def _module_name(path: Path) -> str:
    """``inference/server/app.py`` -> ``inference.server.app``; a package's
    ``__init__.py`` -> ``pkg.__init__``."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _is_package(dotted: str) -> bool:
    return (ROOT / Path(*dotted.split(".")) / "__init__.py").is_file()


def _is_module(dotted: str) -> bool:
    return _is_package(dotted) or (ROOT / Path(*dotted.split("."))).with_suffix(".py").is_file()


def _as_module(dotted: str) -> str:
    return f"{dotted}.__init__" if _is_package(dotted) else dotted


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (entry length, layer index)
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), index)
    return None if best is None else best[1]


def _first_party_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of ``inference`` or ``pagoda_kernels`` in the file."""
    module = _module_name(path)
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, up level - 1 packages
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from pkg import name`: the module pkg.name if there is one, else pkg itself.
            targets = [
                f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base
                for alias in node.names
            ]
        else:
            continue
        found += [
            (node.lineno, _as_module(t))
            for t in dict.fromkeys(targets)
            if t.split(".")[0] in PACKAGES
        ]
    return found


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = [_module_name(p) for p in _sources() if _layer(_module_name(p)) is None]
    assert unplaced == [], f"add these to LAYERS in {Path(__file__).name}: {unplaced}"


def test_imports_run_down_the_layers():
    upward = []
    for path in _sources():
        module = _module_name(path)
        own = _layer(module)
        if own is None or module.startswith(MAY_IMPORT_ANYTHING):
            continue
        for line, target in _first_party_imports(path):
            layer = _layer(target)
            if layer is None or layer < own:
                where = "in no layer" if layer is None else f"layer {layer}, above {own}"
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({where})")
    assert upward == [], "imports that run up the stack:\n" + "\n".join(upward)


def _import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other, directly or around a loop (Tarjan's
    strongly connected components of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            if component:
                circles.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles)


def test_no_import_circles_in_the_engine():
    """Within a layer imports may run either way, but never around: a circle (also one of
    ``TYPE_CHECKING`` imports) means two modules cannot be read or tested one at a time."""
    graph = {
        _module_name(path): {
            target for _, target in _first_party_imports(path)
            if target.startswith("inference.") and target != _module_name(path)
        }
        for path in sorted((ROOT / "inference").rglob("*.py"))
    }  # fmt: skip
    circles = _import_circles(graph)
    assert circles == [], "modules that import each other:\n" + "\n".join(map(str, circles))


def test_a_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _import_circles(graph) == [["a", "b", "c"]]


def test_the_operator_never_imports_the_engine():
    """The operator meets the engine only at its command line, probes and metric names."""
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted((ROOT / "operator").rglob("*.py"))
        for line, target in _first_party_imports(path)
    ]
    assert found == []


def test_the_installed_package_never_imports_the_benchmarks():
    """``benchmarks/`` (GPU checks, sweeps, results) is not installed: nothing that is may
    import it."""
    found = []
    for path in [*_sources(), *sorted((ROOT / "operator").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                      if n.split(".")[0] == "benchmarks"]
    assert found == []


@pytest.mark.parametrize(
    ("module", "target", "allowed"),
    [
        ("inference.models.llama", "inference.runner.model_runner", False),
        ("inference.runner.model_runner", "inference.executor.worker", False),
        ("inference.server.app", "inference.bench.common", False),
        ("pagoda_kernels.attention", "inference.config", False),
        ("inference.config", "inference.models.config", True),
        ("inference.executor.multiproc", "inference.runner.step_inputs", True),
        ("inference.cli", "inference.bench.throughput", True),
    ],
)
def test_the_order_says_what_it_should(module, target, allowed):
    """The declared order itself: a few imports it must refuse and allow."""
    assert (_layer(target) >= _layer(module)) is allowed


# What the router may import of the package: itself, and the engine server's error shape
# (FastAPI only). It reaches engines over HTTP, so it runs without torch or a model.
ROUTER_MAY_IMPORT = ("inference.router", "inference.server.errors")


def test_the_router_never_imports_the_engine():
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted((ROOT / "inference" / "router").rglob("*.py"))
        for line, target in _first_party_imports(path)
        if not target.startswith(ROUTER_MAY_IMPORT)
    ]
    assert found == []
