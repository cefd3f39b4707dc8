"""Sizing without tensors: parameter counts and checkpoint bytes (`params`), the ``k3 info`` audit (`audit`), the
``k3 plan`` serving plan (`serving`), a decode step's bytes and FLOPs (`roofline`), whether a model fits in this
machine's memory (`memory`), and the threads or processes it takes (`machine`)."""
