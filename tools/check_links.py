#!/usr/bin/env python3
"""tools/check_links.py [FILE.md ...]: every relative link in the given Markdown files
(default: README.md) must name a file or folder that exists, relative to the file, and an
anchor (#part) into a Markdown file must name one of its headings (slugged as MkDocs does).
Links to web addresses (scheme:...) are not checked; links inside code are not links.
Exits 1, listing each broken link, if any is broken. `make docs` runs it on README.md (the
pages under docs/ are checked by `mkdocs build --strict`)."""

import os
import re
import sys
import unicodedata

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
FENCE = re.compile(r"^\s{0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")


def slug(text):
    """Python-Markdown's toc slugify, which MkDocs uses for heading ids."""
    text = re.sub(r"`|\*|_(?=\W)|(?<=\W)_|\[|\]\([^)]*\)|\]", "", text)  # inline markup
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def prose_lines(path):
    """(line number, text) of the lines outside fenced code, with code spans blanked."""
    fenced = None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            m = FENCE.match(line)
            if m:
                if fenced is None:
                    fenced = m.group(1)
                elif m.group(1) == fenced:
                    fenced = None
                continue
            if fenced is None:
                yield n, CODE_SPAN.sub("", line.rstrip("\n"))


def anchors(path):
    found, seen = set(), {}
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if m:
            s = slug(m.group(1))
            k = seen.get(s, 0)
            seen[s] = k + 1
            found.add(s if k == 0 else f"{s}_{k}")
    return found


def check(path):
    base = os.path.dirname(os.path.abspath(path))
    broken = []
    for n, line in prose_lines(path):
        targets = LINK.findall(line)
        m = REF_DEF.match(line)
        if m:
            targets.append(m.group(1))
        for target in targets:
            if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            file_part = file_part.split("?", 1)[0]
            dest = os.path.normpath(os.path.join(base, file_part)) if file_part else path
            if file_part.startswith("/"):
                broken.append((n, target, "an absolute path"))
            elif not os.path.exists(dest):
                broken.append((n, target, "no such file"))
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                broken.append((n, target, f"no heading with the anchor #{anchor}"))
    return broken


def main(argv):
    files = argv[1:] or ["README.md"]
    bad = 0
    for path in files:
        for n, target, why in check(path):
            print(f"{path}:{n}: broken link {target}: {why}", file=sys.stderr)
            bad += 1
    if bad:
        print(f"check_links: {bad} broken link(s)", file=sys.stderr)
        return 1
    print(f"check_links: every relative link in {', '.join(files)} resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
