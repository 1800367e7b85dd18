"""The trained model out: Hugging Face folders from a run's workers and from saved checkpoints (docs/export.md).

names.py (the HF names of every saved tensor), safetensors_stream.py (files written one tensor at a time),
hf_folder.py (the files beside the weights, atomic publishing), saved_shards.py (a checkpoint read in one
process), export.py (``rlpad export``), command.py (its arguments), value_model.py (the critic's folder and
its loader, ``load_value_model``). Never imports Ray.
"""
