#!/usr/bin/python3
"""Prints the build targets that a ctest selection runs, one per line, for a build that makes only those.

    ctest --test-dir BUILD --show-only=json-v1 [selection...] | scripts/ctest_targets.py BUILD [ALWAYS...]

BUILD must have been configured with CMake's file-API query for the code model
(BUILD/.cmake/api/v1/query/codemodel-v2, an empty file made before configuring): its reply maps
every target's artifacts (executables, libraries) to the target. A test runs a target when its
command, one of its arguments or one of its REQUIRED_FILES is one of those artifacts. ctest's JSON
leaves out the command of a test whose program is not built yet, so the commands are read from the
CTestTestfile.cmake files that CMake writes into BUILD. ALWAYS are printed first, whatever the
selection: the test binary, whose own tests ctest lists only once it is built.
"""
import glob
import json
import os
import re
import sys

# One argument of a CTestTestfile.cmake command: [=[bracketed]=], "quoted" or bare.
ARGUMENT = re.compile(r'\[(=*)\[(.*?)\]\1\]|"((?:[^"\\]|\\.)*)"|([^\s()]+)')


def artifacts(build):
    """Maps each target artifact's real path in BUILD to its target's name."""
    reply = os.path.join(build, ".cmake", "api", "v1", "reply")
    indexes = sorted(glob.glob(os.path.join(reply, "index-*.json")))
    if not indexes:
        sys.exit(f"ctest_targets.py: {reply} has no code model; create "
                 f"{build}/.cmake/api/v1/query/codemodel-v2 and configure again")
    with open(indexes[-1]) as f:
        index = json.load(f)
    models = [o["jsonFile"] for o in index["objects"] if o["kind"] == "codemodel"]
    if not models:
        sys.exit(f"ctest_targets.py: {indexes[-1]} holds no code model (the query is missing)")
    with open(os.path.join(reply, models[0])) as f:
        model = json.load(f)
    paths = {}
    for config in model["configurations"]:
        for ref in config["targets"]:
            with open(os.path.join(reply, ref["jsonFile"])) as f:
                target = json.load(f)
            for artifact in target.get("artifacts", []):
                path = artifact["path"]
                if not os.path.isabs(path):
                    path = os.path.join(build, path)
                paths[os.path.realpath(path)] = target["name"]
    return paths


def test_commands(build):
    """Maps each test that BUILD's CTestTestfile.cmake files add to its command and arguments."""
    commands = {}
    for path in glob.glob(os.path.join(build, "**", "CTestTestfile.cmake"), recursive=True):
        with open(path) as f:
            for line in f:
                if not line.startswith("add_test("):
                    continue
                words = [m.group(2) if m.group(2) is not None else
                         m.group(3) if m.group(3) is not None else m.group(4)
                         for m in ARGUMENT.finditer(line[len("add_test("):].rstrip().rstrip(")"))]
                if words:
                    commands[words[0]] = words[1:]
    return commands


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: ctest --show-only=json-v1 ... | ctest_targets.py BUILD_DIR [ALWAYS...]")
    build = os.path.realpath(sys.argv[1])
    by_path = artifacts(build)
    commands = test_commands(build)
    targets = list(sys.argv[2:])
    for test in json.load(sys.stdin).get("tests", []):
        paths = list(test.get("command") or commands.get(test["name"], []))
        for prop in test.get("properties", []):
            if prop.get("name") == "REQUIRED_FILES":
                paths += prop.get("value", [])
        for path in paths:
            name = by_path.get(os.path.realpath(path)) if os.path.isabs(path) else None
            if name and name not in targets:
                targets.append(name)
    print("\n".join(targets))


if __name__ == "__main__":
    main()
