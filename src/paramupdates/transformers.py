"""The public import path of ``paramupdates.integrations.transformers``: ``paramupdates.transformers`` is that
module itself (one module object, so patching or reading an attribute through either name is the same)."""

import sys

from .integrations import transformers as _impl

sys.modules[__name__] = _impl
