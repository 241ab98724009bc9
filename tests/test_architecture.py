"""Imports run one way (docs/architecture.md): the core imports neither gRPC nor the generated code
nor the packages above it; the client imports the core; the worker, the admin CLI, the HTTP API and
the engine connectors import the client (the API also the worker); nothing in tiercache/ imports server/
but the entry point; scripts never import tests/. Within the core, sub-layers: the store's policy
and placement sit above the tiers, the tiers above the same-host protocol and the block vocabulary;
above the core only the daemon reaches the store or a tier."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
ABOVE_CORE = ("tiercache.client", "tiercache.worker", "tiercache.admin", "tiercache.api", "tiercache.integrations",
              "tiercache.cli", "tiercache.entry")
# package (or module) -> the imports it may not make, module prefixes
FORBIDDEN = {
    "core": ("grpc", "grpc_health", "tiercache.v1", "server", *ABOVE_CORE),
    "tiercache.client": ("server", "tiercache.worker", "tiercache.admin", "tiercache.api", "tiercache.integrations",
                         "tiercache.cli"),
    "tiercache.worker": ("server", "tiercache.admin", "tiercache.api", "tiercache.integrations", "tiercache.cli"),
    "tiercache.admin": ("server", "tiercache.api", "tiercache.integrations", "tiercache.cli"),
    "tiercache.api": ("server", "tiercache.admin", "tiercache.integrations", "tiercache.cli"),
    "tiercache.integrations": ("server", "tiercache.worker", "tiercache.admin", "tiercache.api", "tiercache.cli"),
    "server": ("tiercache.client", "tiercache.worker", "tiercache.admin", "tiercache.api", "tiercache.integrations",
               "tiercache.cli"),
}


# Sub-layers of the core, and what sits above it, by module prefix: the imports each may not make.
STORE = ("tiercache.store", "tiercache.store_types", "tiercache.store_upkeep", "tiercache.store_reserved",
         "tiercache.store_scrub", "tiercache.reservations", "tiercache.placement", "tiercache.index")
TIERS = ("tiercache.tiers",)
SUB_LAYERS = {
    "tiercache.tiers": STORE,  # a tier never reaches up to the index or the store
    "tiercache.samehost": (*STORE, *TIERS),  # the slab's protocol knows no tier, index or store
    "tiercache.block": (*STORE, *TIERS, "tiercache.samehost", "tiercache.codec", "tiercache.record_header"),
    "tiercache.client": (*STORE, *TIERS),  # the client speaks the block vocabulary, not the daemon's insides
    "tiercache.worker": (*STORE, *TIERS, "server"),
    "tiercache.api": (*STORE, *TIERS),
    "tiercache.integrations": (*STORE, *TIERS),
    "tiercache.admin": (*STORE, *TIERS),
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports in functions count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def layer(module: str) -> str | None:
    if module.startswith("tiercache.v1"):
        return None  # generated code
    for name in ("tiercache.client", "tiercache.worker", "tiercache.admin", "tiercache.api", "tiercache.integrations",
                 "server"):
        if module == name or module.startswith(name + "."):
            return name
    if module in ("tiercache.cli", "tiercache.entry"):
        return None  # the entry point wires everything together
    return "core" if module.startswith("tiercache") else None


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_imports_run_one_way() -> None:
    wrong = []
    for path in sorted([*(REPO / "tiercache").rglob("*.py"), *(REPO / "server").rglob("*.py")]):
        name = module_name(path)
        rules = FORBIDDEN.get(layer(name) or "", ())
        wrong += [f"{name} imports {m}" for m in sorted(imports(path)) if under(m, rules)]
    assert not wrong, "imports against the architecture:\n" + "\n".join(wrong)


def test_sub_layers_of_the_core_and_above_it() -> None:
    wrong = []
    for path in sorted((REPO / "tiercache").rglob("*.py")):
        name = module_name(path)
        for prefix, rules in SUB_LAYERS.items():
            if under(name, (prefix,)):
                wrong += [f"{name} imports {m}" for m in sorted(imports(path)) if under(m, rules)]
    assert not wrong, "imports against the core's sub-layers:\n" + "\n".join(wrong)


def test_only_the_entry_point_imports_the_server() -> None:
    importers = {module_name(p) for p in (REPO / "tiercache").rglob("*.py")
                 if any(under(m, ("server",)) for m in imports(p))}
    assert importers <= {"tiercache.cli"}, importers


def test_scripts_and_benchmarks_never_import_tests() -> None:
    wrong = [f"{p.relative_to(REPO)} imports {m}" for p in sorted([*(REPO / "scripts").rglob("*.py"),
                                                                    *(REPO / "benchmarks").rglob("*.py")])
             for m in imports(p) if under(m, ("tests", "helpers_daemon", "reliability", "blocks", "conftest"))]
    assert not wrong, "\n".join(wrong)


def test_only_the_connector_module_imports_vllm() -> None:
    """vLLM is no requirement of tiercache: one module translates its objects, the rest is plain Python."""
    importers = {module_name(p) for p in (REPO / "tiercache").rglob("*.py")
                 if any(under(m, ("vllm",)) for m in imports(p))}
    assert importers <= {"tiercache.integrations.vllm.connector"}, importers
