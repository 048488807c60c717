"""mkdocs hooks for the docs site (mkdocs.yml: ``hooks``). Nothing here imports a deep-learning framework.

- ``<!-- distkeras:options NAME -->`` in a page becomes the adapter of backend NAME (``all``: every backend),
  found through ``distkeras.backends.REGISTRY``: its summary and a table of its ``options`` dict, the
  keyword arguments ``distribute()`` accepts on that backend. The pages never name an adapter's module.
- ``<!-- distkeras:cli COMMAND -->`` becomes the options of ``distkeras COMMAND``, read from the argparse
  parser the command line itself uses.
- The benchmark plots (``benchmarks/**/*.png``) and ``CHANGELOG.md`` are published from where they live in
  the repository, so the site never holds a second copy of them.
"""

import argparse
import glob
import html
import importlib
import inspect
import os
import re
import sys
import textwrap

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS_MARKER = re.compile(r"^<!-- distkeras:options (\w+) -->$", re.M)
CLI_MARKER = re.compile(r"^<!-- distkeras:cli (\w+) -->$", re.M)


def on_config(config):
    # This checkout's distkeras, whatever is installed.
    src = os.path.join(ROOT, "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def on_files(files, config):
    for path in sorted(glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.png"), recursive=True)):
        files.append(File.generated(config, os.path.relpath(path, ROOT).replace(os.sep, "/"), abs_src_path=path))
    files.append(File.generated(config, "changelog.md", abs_src_path=os.path.join(ROOT, "CHANGELOG.md")))
    return files


def _cell(text):
    return html.escape(" ".join(str(text).split()), quote=False).replace("|", "\\|")


def adapter_class(name):
    """The adapter class of backend ``name``, from the registry (importing an adapter imports no framework)."""
    from distkeras import backends

    module_name, _, class_name = backends.REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def _summary(cls):
    """The class' own docstring, else the first paragraph of its module's."""
    own = cls.__dict__.get("__doc__")
    text = inspect.cleandoc(own) if own else (inspect.getdoc(sys.modules[cls.__module__]) or "").split("\n\n")[0]
    return " ".join(text.split())


def render_options(name):
    from distkeras import backends

    names = list(backends.REGISTRY) if name == "all" else [name]
    out = []
    for backend in names:
        cls = adapter_class(backend)
        if name == "all":
            out.append("### `{}`\n".format(backend))
        out.append("*{}* — framework: `{}`; install: `{}`.\n".format(
            _cell(_summary(cls)), cls.framework, _cell(cls.install_hint)))
        out.append("| option | what it does |\n|---|---|")
        for option, help_text in cls.options.items():
            out.append("| `{}` | {} |".format(option, _cell(help_text)))
        out.append("")
    return "\n".join(out)


def render_cli(command):
    from distkeras import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    out = []
    if sub.description:
        out.append(_cell(sub.description) + "\n")
    out.append("```\n{}\n```\n".format(sub.format_usage().strip()))
    actions = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
    if not actions:
        return "\n".join(out + ["It takes no options.", ""])
    out.append("| option | default | what it does |\n|---|---|---|")
    for action in actions:
        flags = ", ".join("`{}`".format(f) for f in action.option_strings) or "`{}`".format(action.dest.upper())
        if action.required:
            flags += " (required)"
        default = "" if action.default in (None, False, argparse.SUPPRESS) else "`{}`".format(action.default)
        out.append("| {} | {} | {} |".format(flags, default, _cell(action.help or "")))
    if sub.epilog:  # launch's examples ("examples:" and indented lines), as `distkeras COMMAND --help` ends
        title, _, body = sub.epilog.strip().partition("\n")
        out.append("\n{}\n\n```bash\n{}\n```\n".format(title.capitalize(), textwrap.dedent(body)))
    out.append("")
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    markdown = OPTIONS_MARKER.sub(lambda m: render_options(m.group(1)), markdown)
    return CLI_MARKER.sub(lambda m: render_cli(m.group(1)), markdown)
