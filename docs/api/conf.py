"""Sphinx configuration of the API reference, generated from the docstrings (autodoc).

Build: ``python -m sphinx -W --keep-going -b html docs/api build/api`` (``.ci/run`` does).
"""

project = "paramupdates"
author = "The paramupdates developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
nitpicky = False
html_theme = "alabaster"
exclude_patterns = ["_build"]
