"""Real models: named checkpoints, their weights, tokenizers and chat templates.

`registry` (the models `pdserve model pull` fetches), `weights` (seeded random or a Hugging Face
checkpoint, loaded into the model), `tokenizer`, `chat_template`.

May import: `engine.model`, `engine.config`, `engine.gguf_file`.
"""
