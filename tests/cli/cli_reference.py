#!/usr/bin/env python3
"""docs/cli.md against the command itself, in both directions.

For every subcommand `hpmoe SUB --help` lists, docs/cli.md must have a
section `## hpmoe SUB` whose tables name each of its options (and its
positionals); a section that links to the layer options counts that
table's options too. Every option the page names must also exist, so a
renamed or removed flag fails here instead of misleading a reader.

usage: cli_reference.py HPMOE DOCS/CLI.MD
"""
import re
import subprocess
import sys

LONG = re.compile(r"--[a-z][a-z0-9-]*")


def run_help(hpmoe, *args):
    out = subprocess.run([hpmoe, *args, "--help"], capture_output=True, text=True, check=True).stdout
    return out


def subcommands(hpmoe):
    text = run_help(hpmoe)
    names, inside = [], False
    for line in text.splitlines():
        if line.startswith("Subcommands:"):
            inside = True
            continue
        if inside:
            m = re.match(r"^  ([a-z][a-z-]*)\s", line)
            if m:
                names.append(m.group(1))
            elif line and not line.startswith(" "):
                inside = False
    return names


def help_options(hpmoe, sub):
    """The options and positionals `hpmoe SUB --help` lists (without --help)."""
    opts, section = set(), None
    for line in run_help(hpmoe, sub).splitlines():
        if line.endswith(":") and not line.startswith(" "):
            section = line[:-1]
            continue
        m = re.match(r"^  (\S+)", line)
        if not m:
            continue
        name = m.group(1)
        if section == "Positionals":
            opts.add(name)
        elif section == "Options":
            opts.update(LONG.findall(name))
    opts.discard("--help")
    return opts


def doc_sections(path):
    sections, title, body = {}, None, []
    for line in open(path, encoding="utf-8"):
        if line.startswith("## "):
            if title:
                sections[title] = "".join(body)
            title, body = line[3:].strip(), []
        elif title:
            body.append(line)
    if title:
        sections[title] = "".join(body)
    return sections


def table_options(body):
    """Options named in the first column of the section's table rows."""
    opts = set()
    for line in body.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        opts.update(LONG.findall(first))
        opts.update(re.findall(r"`([A-Z][A-Z_]*)`", first))  # positionals: `FILE`
    return opts


def main():
    hpmoe, page = sys.argv[1], sys.argv[2]
    sections = doc_sections(page)
    layer = table_options(sections.get("Layer options", ""))
    problems = []
    subs = subcommands(hpmoe)
    if not subs:
        problems.append("`hpmoe --help` lists no subcommands")
    for sub in subs:
        title = f"hpmoe {sub}"
        if title not in sections:
            problems.append(f"docs/cli.md has no section '## {title}'")
            continue
        body = sections[title]
        documented = table_options(body)
        if "(#layer-options)" in body:
            documented |= layer
        actual = help_options(hpmoe, sub)
        for o in sorted(actual - documented):
            problems.append(f"{title}: {o} is in --help but not in docs/cli.md")
        for o in sorted(documented - actual):
            problems.append(f"{title}: docs/cli.md names {o}, which --help does not list")
    for title in sections:
        if title.startswith("hpmoe ") and title[6:] not in subs:
            problems.append(f"docs/cli.md documents '{title}', which `hpmoe --help` does not list")
    for p in problems:
        print("error:", p, file=sys.stderr)
    if problems:
        return 1
    print(f"docs/cli.md matches --help for {len(subs)} subcommands")
    return 0


if __name__ == "__main__":
    sys.exit(main())
