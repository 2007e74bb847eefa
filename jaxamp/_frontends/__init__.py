"""The front-ends over the update engine (``jaxamp/_engine.py``): the optax
transformation, ``apply_scaled_updates``, gradient accumulation, torch's
``GradScaler`` with its ``Optimizer`` handle, and ``state_dict`` checkpoints."""
