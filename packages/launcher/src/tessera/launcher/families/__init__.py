"""What ``boost()`` knows about a model: the model contract (`ModelSpec`, ``spec``), the models
and Hugging Face families registered by name (``known``), a plan of roles read from any module
tree (``derived_roles``), Hugging Face pipeline blocks (``hf``) and MoE conversion (``hf_moe``)."""
