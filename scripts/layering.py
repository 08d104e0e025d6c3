#!/usr/bin/env python3
"""Checks that libfsdp's library layers only look down, and that no files form a cycle.

Every file of src/ and include/fsdp/ belongs to one layer (LAYERS below, lowest first). It fails,
naming the files, when
  - a file includes a file of a higher layer;
  - files include each other in a cycle;
  - components depend on each other in a cycle, or a source depends on a higher layer's source, at
    link level. A component is a header with the sources that define the functions it declares
    (Universal Ctags finds declarations and definitions); a file depends on the components of the
    headers it includes, so a source A depends on source B when A includes a header B implements.
  - a file is in no layer.
Usage: scripts/layering.py [--graph]   (--graph also prints each layer's files and what they use)
Needs python3 and universal-ctags (Debian's universal-ctags).
"""
import fnmatch
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. A file belongs to the first layer with a pattern that matches its path.
LAYERS = [
    ("foundation", [  # public vocabulary and standalone facilities; no FSDP runtime below them
        "include/fsdp/check.h", "src/check.cpp",
        "include/fsdp/comm.h",
        "include/fsdp/memory.h", "src/device_memory.cpp",
        "include/fsdp/trace.h",
        "include/fsdp/wrap_policy.h", "src/wrap_policy.cpp",
        "include/fsdp/deferred_init.h", "src/deferred_init_impl.h", "src/deferred_init.cpp",
        "include/fsdp/explicit_unit.h",
        "include/fsdp/options.h", "src/options.cpp",
        "include/fsdp/optim.h", "src/optim.cpp", "src/optimizer_state_key.h",
        "include/fsdp/rank_env.h", "src/rank_env.cpp", "src/env_var.*",
        "src/internal_op_guard.*", "src/tensor_alias.h", "src/exact_sum.*", "src/exact_wire.*",
        "src/job_token.*", "src/block_quantization.*", "src/cpu_features.h",
    ]),
    ("transports", [  # communicators, and the process group that makes them
        "src/comm/*",
        "include/fsdp/network_model.h",
        "include/fsdp/process_group_options.h", "src/process_group_options.cpp",
        "include/fsdp/process_group.h", "src/process_group.cpp",
        "src/rendezvous.*", "src/store_*", "src/member_watch.*", "src/communicator_factory.*",
    ]),
    ("flat parameter", [  # FlatParameters: storage, shards, gradients, their collectives; unit planning
        "src/param_slot.h", "src/flat_param*", "src/flat_grad*",
        "src/sharding_groups.*", "src/unit_plan.*", "src/cpu_offload.*", "src/buffer_pool.*",
        "src/memory_tracker.*", "src/mixed_precision.*", "src/quantized_collectives.*",
    ]),
    ("runtime", [  # one sharded model's runtime: units, scheduling, reduction, hooks
        "src/runtime/*",
        "include/fsdp/unit_scope.h",  # what fsdp::Sharded<M>'s forward calls; the runtime implements it
    ]),
    ("public API", [  # the facade and what is built on it: state dicts, checkpoints, clipping, ...
        "include/fsdp/*",
        "src/*.cpp", "src/*.h", "src/checkpoint/*",
    ]),
]


def files():
    out = []
    for top in ("src", "include/fsdp"):
        for d, _, names in os.walk(os.path.join(ROOT, top)):
            for n in names:
                if n.endswith((".h", ".cpp")):
                    out.append(os.path.relpath(os.path.join(d, n), ROOT))
    return sorted(out)


def layer_of(path):
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatch(path, p) for p in patterns):
            return i
    return None


def includes(path):
    """Project files that `path` includes with #include "...": resolved against src/, include/."""
    out = []
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        for line in f:
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if not m:
                continue
            for base in ("src", "include"):
                candidate = os.path.normpath(os.path.join(base, m.group(1)))
                if os.path.isfile(os.path.join(ROOT, candidate)):
                    out.append(candidate)
                    break
    return out


def cycles(graph):
    """Strongly connected components with more than one node (Tarjan), and self-loops."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def parameter_types(signature):
    """A signature's parameter types: names, default arguments and spaces left out."""
    inner, _, tail = signature.strip().partition(")")
    inner = inner.lstrip("(")
    params, depth, current = [], 0, ""
    for ch in inner:
        depth += ch in "<([{"
        depth -= ch in ">)]}"
        if ch == "," and depth == 0:
            params.append(current)
            current = ""
        else:
            current += ch
    params.append(current)
    types = []
    for param in params:
        param = param.split("=")[0].strip()
        tokens = re.findall(r"[A-Za-z_][A-Za-z_0-9:]*|[^\sA-Za-z_]", param)
        if len(tokens) > 1 and re.fullmatch(r"[A-Za-z_][A-Za-z_0-9]*", tokens[-1]) and tokens[-1] not in (
                "const", "int", "long", "short", "char", "unsigned", "signed", "double", "float", "bool"):
            tokens = tokens[:-1]  # the parameter's name
        types.append("".join(tokens))
    return "(" + ",".join(t for t in types if t and t != "void") + ")" + tail.replace(" ", "")


def tags(paths):
    """(kind, key, short name, file) of every function definition and declaration; the key is the
    qualified name with the parameter types, so overloads stay apart."""
    cmd = ["ctags", "--languages=C++", "--map-C++=+.h", "--kinds-C++=fp", "--extras=-q", "-x",
           "--_xformat=%{kind}|%{scope}|%{name}|%{signature}|%{input}"] + paths
    text = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    out = []
    for line in text.splitlines():
        kind, scope, name, signature, path = line.split("|", 4)
        if "__anon" in scope or name.startswith(("__anon", "operator")):
            continue  # file-local, or an operator (not called by name)
        qname = (scope + "::" if scope else "") + name
        out.append((kind, qname + parameter_types(signature), qname, path))
    return out


def main():
    graph_wanted = "--graph" in sys.argv[1:]
    if not shutil.which("ctags"):
        print("layering: universal-ctags is missing (apt-get install universal-ctags)", file=sys.stderr)
        return 77
    paths = files()
    problems = []
    layer = {}
    for p in paths:
        layer[p] = layer_of(p)
        if layer[p] is None:
            problems.append(f"{p}: in no layer; add it to LAYERS in scripts/layering.py")
    inc = {p: includes(p) for p in paths}

    # Includes: never upward; no cycles.
    for p in paths:
        for q in inc[p]:
            if layer[p] is not None and layer[q] is not None and layer[q] > layer[p]:
                problems.append(f"{p} ({LAYERS[layer[p]][0]}) includes {q} ({LAYERS[layer[q]][0]}): an upward include")
    for c in cycles(inc):
        problems.append("include cycle: " + " -> ".join(c))

    # Link level: which source defines what each header declares, and who calls it.
    declared_in = {}  # qualified name -> headers
    defined_in = {}   # qualified name -> sources
    for kind, key, qname, path in tags(paths):
        if path.endswith(".h") and kind == "prototype":
            declared_in.setdefault(key, set()).add(path)
        elif path.endswith(".cpp") and kind == "function":
            defined_in.setdefault(key, set()).add(path)
    implements = {}  # source -> headers whose declarations it defines
    provided = {}    # header -> [(source, qualified name)]
    for key, sources in defined_in.items():
        for h in declared_in.get(key, ()):
            for s in sources:
                implements.setdefault(s, set()).add(h)
                provided.setdefault(h, []).append((s, key.split("(")[0]))
    # Components: a header with the sources that define its functions (one unit at link level).
    parent = {p: p for p in paths}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for h, defs in provided.items():
        for d, _ in defs:
            parent[find(d)] = find(h)
    component_graph = {}
    for p in paths:
        for q in inc[p]:
            if find(q) != find(p):
                component_graph.setdefault(find(p), set()).add(find(q))
    members = {}
    for p in paths:
        members.setdefault(find(p), []).append(p)
    for c in cycles(component_graph):
        problems.append("link-level cycle: " + " -> ".join("{" + ", ".join(sorted(members[x])) + "}" for x in c))
    # A source depends on the sources that implement the headers it (or a header it implements) includes.
    calls = {}
    for s in (p for p in paths if p.endswith(".cpp")):
        seen = set(inc[s])
        for h in implements.get(s, ()):
            seen.update(inc[h])
        for h in seen:
            for d, _ in provided.get(h, ()):
                if find(d) != find(s):
                    calls.setdefault(s, set()).add(d)
    for s, targets in sorted(calls.items()):
        for d in sorted(targets):
            if layer[s] is not None and layer[d] is not None and layer[d] > layer[s]:
                problems.append(f"{s} ({LAYERS[layer[s]][0]}) depends on {d} ({LAYERS[layer[d]][0]}) at link "
                                "level: it includes a header that the higher layer implements")

    if graph_wanted:
        for i, (name, _) in enumerate(LAYERS):
            print(f"== {name}")
            for p in paths:
                if layer[p] != i:
                    continue
                uses = sorted(set(inc[p]) | calls.get(p, set()))
                print(f"  {p}" + (": " + ", ".join(uses) if uses else ""))
    for p in problems:
        print("layering: " + p, file=sys.stderr)
    if problems:
        return 1
    print(f"layering: {len(paths)} files in {len(LAYERS)} layers; no upward include, no upward call, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
