#!/usr/bin/env python3
"""No class or struct holds more than MAX data members (issue rule: a class that
big is several concepts; group them). Counts the non-static data members each
class or struct body declares (`int a, b;` is 2), in the project's C++ and CUDA
sources (generated code and build folders excluded). Nested classes count on
their own. Prints each class over the limit; exit 1 if any.

Usage: class_members.py SOURCE_DIR [--list N]  (--list: the N largest, no check)
"""
import os
import re
import sys

MAX = 25
TOPS = ("base", "kernels", "proto", "daemon", "agent", "cli", "client", "tests")
SOURCE_EXT = (".h", ".cc", ".cu", ".cuh")
HEAD_RE = re.compile(r"\b(class|struct)\s+(?:alignas\([^)]*\)\s*)?([A-Za-z_]\w*)\s*(?:final\s*)?(?::[^;{]*)?\{")
SKIP_RE = re.compile(r"^(using|typedef|friend|static|enum|template|public|private|protected|case|default|return|"
                     r"class|struct|namespace)\b")


def strip(text):
    """Comments and string/char literals blanked, so braces in them do not count."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    return re.sub(r"'(?:\\.|[^'\\\n])*'", "''", text)


def top_level(body):
    """The body's statements at depth 0 (nested blocks replaced by {})."""
    out, depth, cur = [], 0, []
    for ch in body:
        if ch == "{":
            if depth == 0:
                cur.append("{}")
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0 and re.search(r"\)\s*(const\s*)?(noexcept\s*)?(override\s*)?(final\s*)?\{\}$", "".join(cur).rstrip()):
                out.append("".join(cur))  # an inline function body ends the statement
                cur = []
        elif depth == 0:
            cur.append(ch)
            if ch == ";":
                out.append("".join(cur))
                cur = []
    return out


def split_top(decl):
    """Commas outside <>, (), {} and []: the declarators of one declaration."""
    parts, depth, cur = [], 0, []
    for ch in decl:
        if ch in "<({[":
            depth += 1
        elif ch in ">)}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def members(stmt):
    s = re.sub(r"^\s*(public|private|protected)\s*:", "", stmt.strip()).strip()
    s = re.sub(r"^\s*(public|private|protected)\s*:", "", s).strip()
    if not s.endswith(";") or SKIP_RE.match(s) or s.startswith("~") or "operator" in s:
        return 0
    s = s[:-1]
    if s.endswith("{}"):  # a nested type's body or an inline function
        return 0
    head = re.split(r"[={]", s, maxsplit=1)[0]
    if "(" in head:  # a function declaration (a member's initializer comes after = or {)
        return 0
    return len(split_top(s))


def classes(text):
    text = strip(text)
    for m in HEAD_RE.finditer(text):
        start, depth = m.end(), 1
        i = start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        yield m.group(2), text[:m.start()].count("\n") + 1, sum(members(s) for s in top_level(text[start:i - 1]))


def main():
    src = sys.argv[1]
    found = []
    for top in TOPS:
        for root, dirs, files in os.walk(os.path.join(src, top)):
            dirs[:] = [d for d in dirs if not d.startswith("build")]
            for name in files:
                if name.endswith(SOURCE_EXT) and ".pb." not in name:
                    path = os.path.join(root, name)
                    with open(path, encoding="utf-8", errors="replace") as f:
                        for cls, line, n in classes(f.read()):
                            found.append((n, os.path.relpath(path, src), line, cls))
    found.sort(reverse=True)
    if "--list" in sys.argv:
        for n, path, line, cls in found[:int(sys.argv[sys.argv.index("--list") + 1])]:
            print(f"{n:3d} {cls} {path}:{line}")
        return 0
    over = [f for f in found if f[0] > MAX]
    for n, path, line, cls in over:
        print(f"{path}:{line}: {cls} has {n} data members (at most {MAX}: group them by concept)")
    print(f"{len(found)} classes and structs, the largest {found[0][0] if found else 0} data members: "
          f"{len(over)} over {MAX}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
