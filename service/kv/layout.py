"""The stored K/V layout's version, apart from the tensor code so that keys can be made without torch."""

LAYOUT_VERSION = 2  # bump when the meaning of stored tensors changes (2: blocks carry their base position)
