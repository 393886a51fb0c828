"""Models ftrain trains: the built-in architectures (``model.arch``), the protocol through which any
other model tells the runtime where its blocks are and how to call them (:mod:`ftrain.models.layout`),
and implementations of it for Hugging Face causal LMs (:mod:`ftrain.models.hf`) and torchtitan-style
models (:mod:`ftrain.models.titan`). This package's ``__init__`` stays free of torch."""
