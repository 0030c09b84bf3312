"""What a fit shows the user: the plan (``plan_report``), the model summary, training ``curves``, the dynamic
tables' counters (``dynamic_monitor``), and ``QuantizedPredictor`` for ``Trainer.predict``.
May import training/ (``deferred``) and the layers below; never strategies/, parameters/ or checkpoints/.
"""
