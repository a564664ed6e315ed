#!/usr/bin/env python3
"""The house's size rules (the developers' guide): no source file over 700
lines, no function over 150 in src/ and include/, and none over 80 in the
runtime's engine (the engine files of src/runtime). Prints the longest
functions and exits 1 on a breach.

    scripts/check_shape.py [REPO]   (--top N: list the N longest)
"""
import pathlib
import re
import sys

MAX_FILE, MAX_FUNCTION, MAX_ENGINE_FUNCTION = 700, 150, 80


def strip(src):
    """Comments, strings and preprocessor lines out, line breaks kept."""
    src = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), src, flags=re.S)
    src = re.sub(r'R"\((.*?)\)"', lambda m: '""' + "\n" * m.group(0).count("\n"), src, flags=re.S)
    src = re.sub(r"//[^\n]*", "", src)
    src = re.sub(r'"([^"\\\n]|\\.)*"', '""', src)
    src = re.sub(r"'([^'\\\n]|\\.)*'", "''", src)
    return re.sub(r"^\s*#[^\n]*", "", src, flags=re.M)


def functions(path):
    """(lines, first line, head) of each function body outside another one."""
    s = strip(path.read_text())
    out, stack, head_start, line, fn_depth = [], [], 0, 1, None
    for i, ch in enumerate(s):
        if ch == "\n":
            line += 1
        elif ch == ";" and fn_depth is None:
            head_start = i + 1
        elif ch == "{":
            head = s[head_start:i].strip()
            kind = "block"
            if fn_depth is None:
                scope = re.search(r"\b(namespace|class|struct|enum|union)\b", head.split("(")[0])
                if scope and not head.endswith(")"):
                    kind = "scope"
                elif ")" in head and not re.search(r"=\s*$", head):
                    kind = "fn"
                elif head.startswith("extern"):
                    kind = "scope"
            stack.append((kind, line - head.count("\n"), head.split("\n")[0][:70]))
            if kind == "fn":
                fn_depth = len(stack)
            if fn_depth is None:
                head_start = i + 1
        elif ch == "}" and stack:
            kind, first, head = stack.pop()
            if kind == "fn" and fn_depth == len(stack) + 1:
                out.append((line - first + 1, first, head))
                fn_depth = None
            if fn_depth is None:
                head_start = i + 1
    return out


def main(argv):
    top = 0
    if "--top" in argv:
        k = argv.index("--top")
        top = int(argv[k + 1])
        del argv[k : k + 2]
    repo = pathlib.Path(argv[1] if len(argv) > 1 else ".")
    files = sorted(p for d in ("src", "include", "python") for p in (repo / d).rglob("*") if p.suffix in (".cpp", ".hpp"))
    breaches, found = [], []
    for f in files:
        rel = f.relative_to(repo)
        n = f.read_text().count("\n")
        if n > MAX_FILE:
            breaches.append(f"{rel}: {n} lines (the limit is {MAX_FILE}: split it by what its parts are)")
        limit = MAX_ENGINE_FUNCTION if f.parent.name == "runtime" and f.name.startswith("engine") else MAX_FUNCTION
        for lines, first, head in functions(f):
            found.append((lines, f"{rel}:{first}", head))
            if lines > limit and not str(rel).startswith("python"):
                breaches.append(f"{rel}:{first}: a function of {lines} lines (the limit here is {limit}): {head}")
    found.sort(reverse=True)
    for lines, where, head in found[:top]:
        print(f"{lines:5d}  {where}  {head}")
    for b in breaches:
        print("check_shape:", b, file=sys.stderr)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
