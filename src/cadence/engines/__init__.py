"""What a worker steps: the `Engine` contract (`base.py`) and its engines: `synthetic.py` (a
timing model of a real engine, no tensor work), `llama/` (torch, paged KV cache), `app.py` (a
user's generator function), `user_model.py` (a user's batched model class),
`transformers_model.py` (a Hugging Face model). An engine reads `cadence.vocabulary.AddRequest`
and imports nothing of the front."""
