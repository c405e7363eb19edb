"""The main job (``tessera train``): the reference GPT, or its mixture-of-experts variant
(``moe_model``), trained on the character corpus or the user's tokens, with a run folder of metrics
and plots (``runlog``) and a single-process reference speed (``serial_speed``). It uses the
launcher's public API: ``boost``, `Engine`, the configuration and the data readers."""
