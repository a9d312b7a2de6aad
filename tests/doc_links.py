#!/usr/bin/env python3
"""Checks that every relative link of README.md and docs/**/*.md points to a file or folder of the
repository: Markdown links and images, [text](path) and ![alt](path), with or without a #fragment.
Links with a scheme (https:, mailto:) and pure #fragments are not checked; text in code spans and
fenced code blocks is not a link.

Usage: doc_links.py ROOT
Prints every broken link as FILE:LINE: TARGET and exits with 1 if there is any.
"""
import os
import re
import sys

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
FENCE = re.compile(r"^\s*```")


def documents(root):
    yield os.path.join(root, "README.md")
    for folder, _, files in os.walk(os.path.join(root, "docs")):
        for name in sorted(files):
            if name.endswith(".md"):
                yield os.path.join(folder, name)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    broken, checked = [], 0
    for doc in documents(root):
        in_code = False
        with open(doc, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if FENCE.match(line):
                    in_code = not in_code
                    continue
                if in_code:
                    continue
                for target in LINK.findall(CODE_SPAN.sub("", line)):
                    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                        continue
                    path = target.split("#", 1)[0]
                    checked += 1
                    if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(doc), path))):
                        broken.append(f"{os.path.relpath(doc, root)}:{n}: {target}")
    for b in broken:
        print(b)
    print(f"doc_links: {checked} relative links checked, {len(broken)} broken")
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
