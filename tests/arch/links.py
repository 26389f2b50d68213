#!/usr/bin/env python3
"""Every relative link in the repository resolves: markdown links in README.md and
docs/ (and any other tracked .md), and the docs/... or README.md references in code
comments, each to a file that exists and, where it names one, a heading anchor that
file has (GitHub's slugs). Prints each broken link with where it is; exit 1 if any.

    links.py REPO_ROOT
"""
import os
import re
import subprocess
import sys

CODE_SUFFIXES = (".cc", ".h", ".cu", ".cuh", ".py", ".sh", ".proto", ".txt", ".yml", ".yaml", ".service", ".nft")
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# In code: docs/name.md, docs/name.md#anchor, README.md#anchor (as text, not markdown).
CODE_REF = re.compile(r"(?<![\w/.-])((?:\.\./)*(?:docs/[\w.-]+\.md|README\.md)(?:#[\w-]+)?)")


def tracked_files(root):
    out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if os.path.exists(os.path.join(root, f))]


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path, cache={}):
    if path not in cache:
        seen, found = {}, set()
        in_fence = False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("```"):
                    in_fence = not in_fence
                    continue
                m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
                if m and not in_fence:
                    s = slug(m.group(2))
                    n = seen.get(s, 0)
                    found.add(s if n == 0 else f"{s}-{n}")
                    seen[s] = n + 1
        cache[path] = found
    return cache[path]


def check(root, where, base_dir, target, problems):
    if re.match(r"^[a-z]+:", target) or target.startswith("//"):
        return  # http:, https:, mailto:
    path, _, anchor = target.partition("#")
    full = os.path.normpath(os.path.join(base_dir, path)) if path else None
    if full is None:
        return  # an anchor in the same file: checked by the caller
    if not full.startswith(root):
        problems.append(f"{where}: {target}: outside the repository")
        return
    if not os.path.exists(full):
        problems.append(f"{where}: {target}: no such file")
        return
    if anchor and full.endswith(".md") and anchor not in anchors_of(full):
        problems.append(f"{where}: {target}: {os.path.relpath(full, root)} has no heading #{anchor}")


def main():
    root = os.path.abspath(sys.argv[1])
    problems, links = [], 0
    for rel in tracked_files(root):
        full = os.path.join(root, rel)
        if rel.startswith("tests/fixtures/") or "/corpus/" in rel or rel == "tests/arch/links.py":
            continue
        if rel.endswith(".md"):
            # Links may wrap across lines: match on the text with fenced blocks blanked.
            text, in_fence, kept = open(full, encoding="utf-8").read(), False, []
            for line in text.split("\n"):
                if line.startswith("```"):
                    in_fence = not in_fence
                kept.append("" if in_fence or line.startswith("```") else line)
            text = "\n".join(kept)
            for m in MD_LINK.finditer(text):
                target = m.group(1)
                links += 1
                where = f"{rel}:{text.count(chr(10), 0, m.start()) + 1}"
                if target.startswith("#"):
                    if target[1:] not in anchors_of(full):
                        problems.append(f"{where}: {target}: no such heading here")
                else:
                    check(root, where, os.path.dirname(full), target, problems)
        elif rel.endswith(CODE_SUFFIXES) or os.path.basename(rel) == "CMakeLists.txt":
            try:
                text = open(full, encoding="utf-8").read()
            except UnicodeDecodeError:
                continue
            for n, line in enumerate(text.splitlines(), 1):
                for target in CODE_REF.findall(line):
                    links += 1
                    # Code names docs/ and README.md from the repository root.
                    check(root, f"{rel}:{n}", root, target.lstrip("./"), problems)
    for p in problems:
        print(p)
    print(f"{links} links checked, {len(problems)} broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
