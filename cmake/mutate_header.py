#!/usr/bin/env python3
"""Writes a mutated copy of a product header for a mutant test target (cmake/mutants.cmake).

  mutate_header.py HEADER OUT OLD_FILE NEW_FILE [OLD_FILE NEW_FILE]...

Each OLD_FILE holds a text that must occur exactly once in HEADER (and still once after the
replacements before it); it is replaced by the text of NEW_FILE. Any other count is an error that
names the header and the text, so a mutant whose anchor an edit moved fails the build loudly instead
of silently building the unmutated code. OUT is rewritten only when its content changes.
"""
import os
import sys


def main(argv):
    if len(argv) < 5 or (len(argv) - 3) % 2:
        sys.stderr.write(__doc__)
        return 2
    header, out, pairs = argv[1], argv[2], argv[3:]
    with open(header, encoding="utf-8") as f:
        text = f.read()
    for old_file, new_file in zip(pairs[0::2], pairs[1::2]):
        with open(old_file, encoding="utf-8") as f:
            old = f.read()
        with open(new_file, encoding="utf-8") as f:
            new = f.read()
        n = text.count(old) if old else 0
        if n != 1:
            sys.stderr.write(f"mutate_header.py: error: the text to replace occurs {n} times in {header}, "
                             f"not exactly once (re-anchor the mutant in its CMakeLists.txt):\n{old}\n")
            return 1
        text = text.replace(old, new, 1)
    text += f"\n// A mutant: {os.path.basename(header)} with the replacements of cmake/mutants.cmake (test builds only).\n"
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            if f.read() == text:
                return 0
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
