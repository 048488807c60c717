"""Griffe extension for the API reference (mkdocs.yml: mkdocstrings' ``extensions``). Nothing here imports distkeras.

distkeras' docstrings are Google style with reST inline markup, which Markdown shows literally. Before mkdocstrings
parses a docstring, this rewrites, outside ``>>>`` examples:

- reST roles (``:func:`distribute```, ``:class:`~distkeras.errors.VerifyError```, ``:mod:``, ``:data:``, ...) into
  Markdown code: `` `distribute()` ``, `` `VerifyError` `` (``~`` keeps the last name, as Sphinx does);
- reST literals (double backticks) into Markdown code (single backticks), where they hold no backtick;
- a Returns/Yields section that opens with prose holding a colon ("A dict with `backend`; `devices` (strings: the
  ...") so that Griffe doesn't take the words before the colon for the returned type: the type then comes from the
  function's annotation;
- the Attributes of a class made with ``typing.NamedTuple("Name", [("field", type), ...])`` (the Python 3.6 form the
  core uses, whose fields Griffe can't see) so that each one carries its field's type.
"""

import ast
import re

import griffe

ROLE = re.compile(r":(?:py:)?(func|meth|class|exc|mod|data|attr|obj|const|ref):`([^`]+)`")
LITERAL = re.compile(r"(?<!`)``([^`]+?)``(?!`)")
SECTION = re.compile(r"^(\s*)(\w[\w ]*):\s*$")
ITEM = re.compile(r"^(\s*)(\*{0,2}\w+)(\s*\([^)]*\))?:(\s|$)")
TYPE_LIKE = re.compile(r"^[\w.\[\]'\"|,]+$")


def _role(match):
    kind, text = match.groups()
    title, _, target = text.partition("<")
    if target:  # :func:`title <target>`
        name = title.strip()
    else:
        name = text[1:].rpartition(".")[2] if text.startswith("~") else text
        if kind in ("func", "meth") and not name.endswith(")"):
            name += "()"
    return "`{}`".format(name)


def inline(text):
    """reST roles and literals in ``text`` as Markdown code."""
    return LITERAL.sub(lambda m: "`{}`".format(m.group(1)), ROLE.sub(_role, text))


def _is_type(text):
    return bool(TYPE_LIKE.match(text.replace(", ", ",").replace(" | ", "|").strip("() ")))


def rewrite(docstring, field_types=None):
    """``docstring`` with its markup in Markdown, prose Returns protected, and ``field_types`` (name -> type text)
    written into its Attributes items that have no type."""
    lines = docstring.split("\n")
    section, section_indent, item_indent, out = None, 0, None, []
    for line in lines:
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if stripped.startswith((">>>", "... ")):
            out.append(line)
            continue
        header = SECTION.match(line)
        if header:
            section, section_indent, item_indent = header.group(2), indent, None
            out.append(line)
            continue
        if section and stripped and indent <= section_indent:
            section = None
        if section and stripped and item_indent is None:
            item_indent = indent
            if section in ("Returns", "Yields"):  # read as one item: only its first line may hold a type
                before, colon, _ = stripped.partition(":")
                if colon and not _is_type(before):
                    line = line[:indent] + ": " + stripped
        if section == "Attributes" and field_types and stripped and indent == item_indent:
            item = ITEM.match(line)
            if item and not item.group(3) and item.group(2) in field_types:
                line = "{}{} ({}){}".format(line[:indent], item.group(2), field_types[item.group(2)], line[item.end(2):])
        out.append(inline(line))
    return "\n".join(out)


def namedtuple_fields(node):
    """``{field: type text}`` of a class statement whose base is ``typing.NamedTuple("Name", [(field, type), ...])``."""
    fields = {}
    for base in getattr(node, "bases", ()):
        if not (isinstance(base, ast.Call) and ast.unparse(base.func).endswith("NamedTuple") and len(base.args) == 2):
            continue
        if isinstance(base.args[1], (ast.List, ast.Tuple)):
            for pair in base.args[1].elts:
                if isinstance(pair, ast.Tuple) and len(pair.elts) == 2 and isinstance(pair.elts[0], ast.Constant):
                    fields[pair.elts[0].value] = ast.unparse(pair.elts[1])
    return fields


class ReSTToMarkdown(griffe.Extension):
    def on_instance(self, *, node, obj, agent, **kwargs):
        if obj.is_alias or obj.docstring is None:
            return
        fields = namedtuple_fields(node) if obj.is_class else None
        obj.docstring.value = rewrite(obj.docstring.value, fields)
