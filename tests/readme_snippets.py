#!/usr/bin/env python3
"""Turns every ```cpp block of Markdown files (README.md, docs/**/*.md) into C++ translation units,
so that the build can compile what the documentation shows.

Convention (stated again in a comment at the top of README.md):
- a block that defines `int main` is a whole program and is written out as it stands
  (<file>_program_<k>.cpp, compiled and linked);
- any other block is a fragment (<file>_fragment_<k>.cpp, compiled only): its `#include` lines go to the
  top of the file and the rest becomes the body of a function of its own; a fragment without any
  `#include` line gets `#include <fasta2a/fasta2a.hpp>` (one with includes gets only its own, so
  that they are checked as written);
- names a fragment uses but does not declare (a buffer the prose talks about, say) are declared
  by an HTML comment directly above the block, `<!-- snippet-given: DECLARATIONS -->`, which the
  rendered page does not show; the declarations open the function body.

<file> is the Markdown file's path relative to ROOT, lower case, with every other character than a
letter or digit turned into "_" and ".md" left out: readme, docs_design, docs_history_synthesis.
`#line` directives point compiler messages at the Markdown file's own lines.

Usage: readme_snippets.py ROOT OUTDIR FILE.md...
Writes the translation units into OUTDIR (rewriting only those whose text changed, removing stale
ones) and prints one generated file name per line. A file without a ```cpp block adds nothing; no
block in any of them is an error.
"""
import os
import re
import sys

FENCE = re.compile(r"^\s*```\s*([A-Za-z0-9_+-]*)\s*$")
GIVEN = re.compile(r"<!--\s*snippet-given:(.*?)-->", re.S)
MAIN = re.compile(r"\bint\s+main\s*\(")


def blocks(lines, path=""):
    """Yields (language, first line number of the code, code lines, the text just above)."""
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        j = start
        while j < len(lines) and not FENCE.match(lines[j]):
            j += 1
        if j == len(lines):
            sys.exit(f"readme_snippets: {path}: the code block opened at line {i + 1} is never closed")
        # The text between the previous blank line and the fence: where a snippet-given comment sits.
        k = i
        while k > 0 and lines[k - 1].strip():
            k -= 1
        yield lang, start + 1, lines[start:j], "\n".join(lines[k:i])
        i = j + 1


def translation_unit(path, first, code, above):
    """The text of one translation unit and whether it is a program."""
    src = os.path.abspath(path).replace("\\", "/")
    if any(MAIN.search(line) for line in code):
        return f'#line {first} "{src}"\n' + "\n".join(code) + "\n", True
    given = GIVEN.search(above)
    head = []
    body = []
    for n, line in enumerate(code):
        if line.lstrip().startswith("#include"):
            head += [f'#line {first + n} "{src}"', line]
            body.append("")  # keeps the body's lines where they are in the README
        else:
            body.append(line)
    if not head:
        head = ["#include <fasta2a/fasta2a.hpp>"]
    out = head + ["", f"void readme_snippet_at_line_{first}() {{"]
    if given:
        out.append(f'#line 1 "{src} (snippet-given above line {first})"')
        out.append(given.group(1).strip())
    out.append(f'#line {first} "{src}"')
    out += body
    out.append("}")
    return "\n".join(out) + "\n", False


def unit_prefix(root, path):
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel.lower().endswith(".md"):
        rel = rel[:-3]
    return re.sub(r"[^a-z0-9]", "_", rel.lower())


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    root, outdir, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.makedirs(outdir, exist_ok=True)
    written = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        prefix = unit_prefix(root, path)
        for k, (lang, first, code, above) in enumerate((b for b in blocks(lines, path) if b[0] == "cpp"), 1):
            text, program = translation_unit(path, first, code, above)
            name = f"{prefix}_{'program' if program else 'fragment'}_{k}.cpp"
            if name in written:
                sys.exit(f"readme_snippets: two files give the unit name {name}")
            target = os.path.join(outdir, name)
            old = None
            if os.path.exists(target):
                with open(target, encoding="utf-8") as f:
                    old = f.read()
            if old != text:
                with open(target, "w", encoding="utf-8") as f:
                    f.write(text)
            written.append(name)
    for name in os.listdir(outdir):
        if re.fullmatch(r"([a-z0-9_]+_)?(program|fragment)_\d+\.cpp", name) and name not in written:
            os.remove(os.path.join(outdir, name))
    if not written:
        sys.exit(f"readme_snippets: no ```cpp block in {', '.join(paths)}")
    print("\n".join(written))


if __name__ == "__main__":
    main()
