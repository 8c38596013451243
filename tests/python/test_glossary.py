"""docs/glossary.md names only code that exists, and names what a reader meets first; so does
docs/architecture.md, in the spelling the code is read in.

Every code span in the glossary that names code is checked against the code:
    sac::Name, sac::Type::member    declared in csrc/ (a regex over the sources: a type by its
                                    class/struct/enum/using declaration, a function by a line that
                                    declares it, a member declared in the file that declares its type)
    sac_plugin.module.Name          an importable attribute; `module.Name` is short for
    _module.Name                    sac_plugin.module.Name, for a module of the package
    torch.ops.sac.name, torch.X     an attribute reachable from the imported module
    csrc/dispatch/region.h          a path of the repository, from its root
A span that would name code but is ambiguous (a bare `Region`, `Policy::decide`, `region.h`) is
refused, so that every name the glossary gives can be checked.

And the other way: every name in sac_plugin.__all__, every type declared at the top level of
the headers a contributor reads first (the region, the thread's activations, the call pipeline,
the scopes, the site, the intercepted call) and the engines' entry points have a glossary entry
that names them (`sac_plugin.Name`, `sac::Name`).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

import sac_plugin

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "glossary.md"
PACKAGE = ROOT / "python" / "sac_plugin"
CSRC = ROOT / "csrc"

# The headers whose top-level types a contributor meets first: each type needs an entry.
FIRST_HEADERS = (
    "csrc/dispatch/call_pipeline.h",
    "csrc/dispatch/intercepted_call.h",
    "csrc/dispatch/region.h",
    "csrc/dispatch/region_scopes.h",
    "csrc/dispatch/site.h",
    "csrc/dispatch/thread_state.h",
)
# Beside them: the rule, the pipeline's two functions and the dispatch-mode engine's region.
FIRST_CXX_NAMES = ("sac::Policy", "sac::Policy::decide", "sac::beginCall", "sac::finishCall", "sac::ModeRegion")

_SPAN = re.compile(r"`([^`\n]+)`")
# Only spans made of these characters can name code; the rest are prose (`context_fn(policy)`, `"attn"`).
_CODE_LIKE = re.compile(r"[\w.:/]+")
_SOURCE_SUFFIXES = (".h", ".cpp", ".py", ".md", ".toml", ".yml", ".yaml", ".txt", ".sh")
# The name, then a base, a body, an underlying type, an alias or a specialisation's arguments: not a
# forward declaration, not `Type::Nested`.
_TYPE_DECLARATION = r"^[ \t]*(?:class|struct|enum class|enum|using)[ \t]+{name}(?!::)(?=[ \t]*(?:[:{{=<]|$))"
# A function's declaration or definition: a return type (or a qualifier) before the name.
_FUNCTION_DECLARATION = r"^[ \t]*(?:[\w:<>,*&]+[ \t]+)+(?:\w+::)*{name}[ \t]*\("


def _sources() -> dict[str, str]:
    files = sorted([*CSRC.rglob("*.h"), *CSRC.rglob("*.cpp")])
    return {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in files}


SOURCES = _sources()


def _files_declaring(name: str, pattern: str) -> list[str]:
    regex = re.compile(pattern.format(name=re.escape(name)), re.M)
    return [path for path, text in SOURCES.items() if regex.search(text)]


def check_cxx(name: str) -> str | None:
    """Why `sac::A` (a type or a function) or `sac::A::member` is not declared in csrc/; None if it is."""
    parts = name[len("sac::") :].split("::")
    if len(parts) > 2 or not all(parts):
        return f"`{name}` is not a name the glossary can check (write sac::Name or sac::Type::member)"
    first = parts[0]
    declaring = _files_declaring(first, _TYPE_DECLARATION)
    if len(parts) == 1:
        if declaring or _files_declaring(first, _FUNCTION_DECLARATION):
            return None
        return f"`{name}`: no type or function {first} is declared in csrc/"
    if not declaring:
        return f"`{name}`: no type {first} is declared in csrc/"
    # Declared, not mentioned in a comment: a function's parenthesis, a field's or an enumerator's end.
    member = re.compile(rf"\b{re.escape(parts[1])}\b(?=[ \t]*[(;,={{}}])")
    if any(member.search(SOURCES[path]) for path in declaring):
        return None
    return f"`{name}`: {first} ({', '.join(declaring)}) has no member {parts[1]}"


def _package_modules() -> set[str]:
    return {path.stem for path in PACKAGE.glob("*.py")} | {path.parent.name for path in PACKAGE.glob("*/__init__.py")}


MODULES = _package_modules()


def _submodule(value, attribute: str):
    """`value`'s submodule `attribute`, imported, where `value` is a package that has one; else None."""
    try:
        spec = value.__spec__ if isinstance(value, ModuleType) else None
    except RuntimeError:  # torch.classes answers every attribute, and raises for a missing class
        return None
    if spec is None or spec.submodule_search_locations is None:
        return None
    try:
        return importlib.import_module(f"{value.__name__}.{attribute}")
    except ImportError:
        return None


def check_python(name: str) -> str | None:
    """Why a dotted Python name does not resolve; None if it does. `module.Name` is
    sac_plugin.module.Name for a module of the package."""
    parts = name.split(".")
    if parts[0] in MODULES:
        parts = ["sac_plugin", *parts]
    value = importlib.import_module(parts[0])
    for position, attribute in enumerate(parts[1:], start=1):
        try:
            value = getattr(value, attribute)
        except (AttributeError, RuntimeError):  # torch.classes raises RuntimeError for a missing class
            value = _submodule(value, attribute)
            if value is None:
                return f"`{name}`: {'.'.join(parts[:position])} has no attribute {attribute}"
    return None


def classify(span: str) -> tuple[str, str] | None:
    """What kind of code name a span is ("cxx", "python", "path", or "ambiguous" with why), or
    None for prose."""
    if not _CODE_LIKE.fullmatch(span):
        return None
    if span.startswith("sac::"):
        return "cxx", span
    if "/" in span:
        return "path", span
    if span.endswith(_SOURCE_SUFFIXES):
        return "ambiguous", f"`{span}`: write the path from the repository's root"
    if "::" in span:
        return "ambiguous", f"`{span}`: write C++ names as sac::{span}"
    if "." in span:
        first = span.split(".")[0]
        if first in ("sac_plugin", "torch") or first in MODULES:
            return "python", span
        return "ambiguous", f"`{span}`: neither sac_plugin, one of its modules, nor torch"
    if span[0].isupper() and span != span.upper():
        return "ambiguous", f"`{span}`: write it as sac::{span} or module.{span}"
    return None


def stale_names(text: str) -> list[str]:
    """Each code name of `text` that the code does not have, as `line N: why`."""
    problems = []
    for match in _SPAN.finditer(text):
        kind = classify(match.group(1))
        if kind is None:
            continue
        what, value = kind
        if what == "cxx":
            why = check_cxx(value)
        elif what == "python":
            why = check_python(value)
        elif what == "path":
            why = None if (ROOT / value).exists() else f"`{value}`: no such path in the repository"
        else:
            why = value
        if why is not None:
            problems.append(f"line {text.count(chr(10), 0, match.start()) + 1}: {why}")
    return problems


def _words_in_sources() -> set[str]:
    texts = [*SOURCES.values(), *(path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py"))]
    return {word for text in texts for word in re.findall(r"\w+", text)}


WORDS = _words_in_sources()
# A bare identifier that reads as code: CamelCase, camelCase or snake_case (not a plain word).
_IDENTIFIER = re.compile(r"_\w+|[A-Z]\w*|[a-z]\w*[A-Z_]\w*")


def stale_architecture_names(text: str) -> list[str]:
    """docs/architecture.md writes its names as a contributor reads them in the code (`Region::serve`,
    `_PassMode.__enter__`, `beginCall`): each C++ `Type::member` must be declared, each name in a
    package module or in torch must resolve, and any other identifier must still be a word of the
    sources. Paths are tools/check_paths.py's."""
    problems = []
    for match in _SPAN.finditer(text):
        span = match.group(1)
        if not _CODE_LIKE.fullmatch(span) or "/" in span or span.endswith(_SOURCE_SUFFIXES):
            continue
        if "::" in span:
            why = check_cxx(span if span.startswith("sac::") else f"sac::{span}")
        elif "." in span and span.split(".")[0] in MODULES | {"sac_plugin", "torch"}:
            why = check_python(span)
        else:
            first = span.split(".")[0]
            code_like = _IDENTIFIER.fullmatch(first) is not None
            why = f"`{span}`: no source in csrc/ or python/ has {first}" if code_like and first not in WORDS else None
        if why is not None:
            problems.append(f"line {text.count(chr(10), 0, match.start()) + 1}: {why}")
    return problems


def named_spans(text: str) -> set[str]:
    return {match.group(1) for match in _SPAN.finditer(text)}


def first_cxx_names() -> list[str]:
    """The C++ names a contributor meets first, each of which needs a glossary entry."""
    names = []
    regex = re.compile(r"^(?:class|struct|enum class|enum)[ \t]+(\w+)\b(?![ \t]*;)", re.M)
    for header in FIRST_HEADERS:
        names.extend(f"sac::{name}" for name in regex.findall(SOURCES[header]))
    return [*names, *FIRST_CXX_NAMES]


def missing_entries(text: str) -> list[str]:
    spans = named_spans(text)
    missing = [
        f"no entry names `sac_plugin.{name}`"
        for name in sac_plugin.__all__
        if not name.startswith("__") and f"sac_plugin.{name}" not in spans
    ]
    missing += [f"no entry names `{name}`" for name in first_cxx_names() if name not in spans]
    return missing


def test_the_glossary_names_only_code_that_exists():
    assert stale_names(GLOSSARY.read_text(encoding="utf-8")) == []


def test_the_glossary_names_what_a_reader_meets_first():
    assert missing_entries(GLOSSARY.read_text(encoding="utf-8")) == []


def test_the_architecture_page_names_only_code_that_exists():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert stale_architecture_names(text) == []


def test_a_stale_architecture_name_is_named_with_its_line():
    text = (
        "`Region::serve`, `HotOpKernel::call`, `CallStep::kServed`, `_PassMode.__enter__`, `beginCall`, `_mode_calls.assemble`,\n"
        "`Region::serveAll`, `_mode_calls.assemble_all`, `beginTheCall`, `RecomputeScope.__enter__`, `checkpoint`,\n"
        "`Region::release_resources`, `Region::keptBytes`\n"
    )
    assert stale_architecture_names(text) == [
        "line 2: `sac::Region::serveAll`: Region (csrc/dispatch/region.h) has no member serveAll",
        "line 2: `_mode_calls.assemble_all`: sac_plugin._mode_calls has no attribute assemble_all",
        "line 2: `beginTheCall`: no source in csrc/ or python/ has beginTheCall",
        "line 2: `RecomputeScope.__enter__`: no source in csrc/ or python/ has RecomputeScope",
    ]


def test_the_headers_read_first_declare_the_region_and_the_pipeline():
    """The list the glossary is checked against is read from the headers: it holds the types the
    region's and the pipeline's entries describe (an empty regex match would check nothing)."""
    names = first_cxx_names()
    for name in ("sac::Region", "sac::ThreadState", "sac::CallInFlight", "sac::CallStep", "sac::RegionHandle"):
        assert name in names, names


def test_a_stale_or_ambiguous_name_is_named_with_its_line():
    text = (
        "- **pass**: `_mode_recompute.RecomputeScope`, `sac::RecomputeScope`, `sac::Region::owner_of_all`,\n"
        "  `csrc/dispatch/no_such_file.h`, `Region`, `Policy::decide`, `region.h`, `self.region`;\n"
        "  `sac::Region`, `sac::Region::serve`, `sac::beginCall`, `_scopes.RegionScope`, "
        '`sac_plugin._C.open_units`, `csrc/dispatch/region.h`, `checkpoint(fn, ...)`, `"attn"`, `kept_calls`\n'
        "- `torch.classes.sac.NoSuchClass`, `sac_plugin.NoSuchName`\n"
    )
    assert stale_names(text) == [
        "line 1: `_mode_recompute.RecomputeScope`: sac_plugin._mode_recompute has no attribute RecomputeScope",
        "line 1: `sac::RecomputeScope`: no type or function RecomputeScope is declared in csrc/",
        "line 1: `sac::Region::owner_of_all`: Region (csrc/dispatch/region.h) has no member owner_of_all",
        "line 2: `csrc/dispatch/no_such_file.h`: no such path in the repository",
        "line 2: `Region`: write it as sac::Region or module.Region",
        "line 2: `Policy::decide`: write C++ names as sac::Policy::decide",
        "line 2: `region.h`: write the path from the repository's root",
        "line 2: `self.region`: neither sac_plugin, one of its modules, nor torch",
        "line 4: `torch.classes.sac.NoSuchClass`: torch.classes.sac has no attribute NoSuchClass",
        "line 4: `sac_plugin.NoSuchName`: sac_plugin has no attribute NoSuchName",
    ]


def test_an_entry_left_out_is_named():
    names = [name for name in sac_plugin.__all__ if not name.startswith("__")]
    text = " ".join(f"`sac_plugin.{name}`" for name in names if name != "Region")
    text += " " + " ".join(f"`{name}`" for name in first_cxx_names() if name != "sac::ThreadState")
    assert missing_entries(text) == ["no entry names `sac_plugin.Region`", "no entry names `sac::ThreadState`"]
