"""The OpenAI wire protocol as pure functions: request bodies in, response bodies out.

`body` (reading a JSON body, the refusal error), `protocol` (request models and validation),
`chat_prompt` (messages to prompt ids), `responses` (stop strings, finish reasons, usage),
`logprobs_format`. No I/O, no server: tested without one.

May import: nothing else of `router`.
"""
