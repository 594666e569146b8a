"""The embedded default model: a tiny Idefics3-shaped VLM trained on generated scenes.

scenes.py     seeded scene generator, captions, question/answer pairs
tokenizer.py  word-level tokenizer + chat template
processor.py  prompt + image processor (tiling, normalisation, <image> expansion)
model.py      the model's layer sizes -> transformers Idefics3Config
data.py       training batches
train.py      `python -m vlmserve.embedded.train` reproduces default_model/
evaluate.py   `python -m vlmserve.embedded.evaluate` scores held-out scenes
"""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
