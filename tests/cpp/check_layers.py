"""The C++ sources are layered; a file may include headers of its own layer and of the layers below.

    python tests/cpp/check_layers.py [csrc directory]

Layers, lowest first (each a directory of csrc/):
    ops          what an op is: catalog, traits, name resolution, counters, leaf helpers
    policy       the keep rule: policies and recompute units
    dispatch     the interception: fallback, regions, data flow, thread state, call profiles
    diagnostics  reports over the layers below: audits
    bindings     the surfaces Python reaches: the TORCH_LIBRARY blocks and the extension module _C

Inside dispatch, the files are layered too, lowest first (DISPATCH_SUBLAYERS names each file's):
    records      what a pass knows and holds, each alone: the key, data flow, the offload pool,
                 storage copies, routing records, sites, the per-op trace, the entry points' names
    parts        the parts a region composes, each with one job: what the forward wrote outside it,
                 the inputs it holds, the calls its recompute skips, its kept outputs, those preserved
                 from a write in the forward, those offloaded
    region       the region and the thread state that activates it, the call profile
    pipeline     what happens to one call, whichever engine brought it (call_pipeline, InterceptedCall)
    engines      how calls arrive: the native fallback, hot-op kernels, the coexisting kernels, the
                 dispatch-mode engine

Every project include ("..." form) must name its layer directory ("ops/op_traits.h", not
"op_traits.h"), so that the layer of every include is plain from its text. Exits 1, naming each
file and include that breaks the order; run by ctest (CMakeLists.txt) and by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LAYERS = ("ops", "policy", "dispatch", "diagnostics", "bindings")
RANK = {layer: rank for rank, layer in enumerate(LAYERS)}
DISPATCH_LAYERS = ("records", "parts", "region", "pipeline", "engines")
# By file stem (a .h and its .cpp share one).
DISPATCH_SUBLAYERS = {
    "sac_key": "records",
    "ivalue_tensors": "records",
    "storage_copy": "records",
    "data_flow": "records",
    "offload": "records",
    "routing_check": "records",
    "site": "records",
    "call_trace": "records",
    "interception": "records",
    "handed_out": "records",
    "outside_writes": "parts",
    "held_inputs": "parts",
    "dead_calls": "parts",
    "kept_outputs": "parts",
    "preserved_writes": "parts",
    "offloaded_outputs": "parts",
    "region": "region",
    "region_scopes": "region",
    "thread_state": "region",
    "call_profile": "region",
    "call_pipeline": "pipeline",
    "intercepted_call": "pipeline",
    "fallback": "engines",
    "hot_op_kernels": "engines",
    "coexistence": "engines",
    "mode_engine": "engines",
}
DISPATCH_RANK = {layer: rank for rank, layer in enumerate(DISPATCH_LAYERS)}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc"}


def problems(csrc: Path) -> list[str]:
    found = []
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in SOURCE_SUFFIXES):
        relative = path.relative_to(csrc)
        layer = relative.parts[0] if len(relative.parts) > 1 else None
        if layer not in RANK:
            found.append(f"{relative}: is in no layer; put it in one of csrc/{{{','.join(LAYERS)}}}/")
            continue
        for included in INCLUDE.findall(path.read_text(encoding="utf-8")):
            target_layer = included.split("/", 1)[0] if "/" in included else None
            if target_layer not in RANK:
                found.append(
                    f'{relative}: #include "{included}" names no layer directory; '
                    f'write it as "<layer>/{included.rsplit("/", 1)[-1]}" with <layer> one of {", ".join(LAYERS)}'
                )
            elif not (csrc / included).is_file():
                found.append(f'{relative}: #include "{included}" names no file under {csrc}')
            elif RANK[target_layer] > RANK[layer]:
                found.append(
                    f'{relative}: #include "{included}" reaches up from layer {layer} to layer '
                    f"{target_layer}; a layer may include only itself and {', '.join(LAYERS[: RANK[layer]]) or 'nothing below'}"
                )
            elif layer == target_layer == "dispatch":
                found.extend(_dispatch_problem(relative, included))
    if (csrc / "dispatch").is_dir():
        for path in sorted((csrc / "dispatch").iterdir()):
            if path.suffix in SOURCE_SUFFIXES and path.stem not in DISPATCH_SUBLAYERS:
                found.append(
                    f"dispatch/{path.name}: is in no layer of dispatch; name its layer in DISPATCH_SUBLAYERS "
                    f"(tests/cpp/check_layers.py), one of {', '.join(DISPATCH_LAYERS)}"
                )
    return found


def _dispatch_problem(relative: Path, included: str) -> list[str]:
    """The include of one dispatch file by another, where it reaches up the dispatch layers."""
    source = DISPATCH_SUBLAYERS.get(relative.stem)
    target = DISPATCH_SUBLAYERS.get(Path(included).stem)
    if source is None or target is None or DISPATCH_RANK[target] <= DISPATCH_RANK[source]:
        return []
    below = ", ".join(DISPATCH_LAYERS[: DISPATCH_RANK[source]]) or "nothing below"
    return [
        f'{relative}: #include "{included}" reaches up from dispatch layer {source} to {target}; '
        f"a dispatch layer may include only itself and {below}"
    ]


def main(argv: list[str]) -> int:
    csrc = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[2] / "csrc"
    if not csrc.is_dir():
        print(f"check_layers: {csrc} is not a directory", file=sys.stderr)
        return 2
    found = problems(csrc)
    for problem in found:
        print(f"check_layers: {problem}", file=sys.stderr)
    if found:
        print(f"check_layers: {len(found)} include(s) break the layer order {' -> '.join(LAYERS)}", file=sys.stderr)
        return 1
    print(f"check_layers: every include in {csrc} points to its own layer or one below ({' -> '.join(LAYERS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
