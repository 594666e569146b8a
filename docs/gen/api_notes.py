"""What each HTTP request field does, for the generated request-field reference
(`docs/gen/api_fields.py`). The fields themselves, their types, defaults and bounds, and
which are refused come from the code; this table only says why.

Keys are `Model.field` (one model) or `field` (every model that has it). A field the
code has and this table lacks stops the generator with a message naming it: a new field
is documented when it is added. Status is "supported" unless IGNORED or REFUSED says so
(the chat refusal table, `UNSUPPORTED_FIELDS`, is read from the code).
"""

from __future__ import annotations

# Declared fields the server accepts and does not use.
IGNORED = frozenset({
    "user", "ChatMessage.name", "ImageURL.detail", "TokenizeRequest.model",
    "DetokenizeRequest.model",
})  # fmt: skip
# Declared fields refused (400) whenever they ask for something.
REFUSED = frozenset({"CompletionRequest.suffix"})

NOTES: dict[str, str] = {
    # --- both endpoints ---------------------------------------------------------------
    "model": "Must be the served model's name (`--served-model-name`, default the "
    "checkpoint folder's name) when sent; another name is a 404.",
    "max_tokens": "Output tokens at most; default `--default-max-tokens` (256).",
    "max_completion_tokens": "OpenAI's newer name for `max_tokens`; wins when both are sent.",
    "temperature": "0 is greedy (under 1e-5 counts as 0); default 1.",
    "top_p": "Nucleus sampling; the top token is always kept.",
    "top_k": "vLLM's extension; 0 (default) is off.",
    "seed": "Per-request seeded generator: the same tokens alone and in any batch; answer i "
    "of n uses seed + i.",
    "stop": "Up to 4 non-empty strings; searched in the new text only, text a stop could "
    "still cut is held back while streaming.",
    "stream": "Server-sent events with text deltas (incremental detokenisation).",
    "stream_options": "`include_usage` adds a final usage chunk.",
    "StreamOptions.include_usage": "A last chunk with no choices and the usage.",
    "n": "1-128 answers as that many requests; answers 1..n-1 share answer 0's prompt KV "
    "through the prefix cache.",
    "presence_penalty": "vLLM's definition over output tokens; out of OpenAI's range "
    "[-2, 2] is a 400.",
    "frequency_penalty": "vLLM's definition over output tokens; out of [-2, 2] is a 400.",
    "repetition_penalty": "vLLM's extension, over prompt and output tokens; in (0, 100].",
    "logit_bias": "Token id (as a string) to a bias in [-100, 100]; a key that is not a "
    "token id is a 400.",
    "min_p": "vLLM's extension, in [0, 1].",
    "min_tokens": "vLLM's extension: EOS and stop token ids are masked until this many "
    "tokens are out.",
    "bad_words": "vLLM's extension: words whose token sequences are never completed.",
    "ignore_eos": "vLLM's extension: keep generating past EOS (to `max_tokens`).",
    "stop_token_ids": "vLLM's extension: token ids that end the answer.",
    "prompt_logprobs": "vLLM's extension (0-20): every prompt token's logprob and this many "
    "alternatives; such a request skips prefix-cache hits.",
    "response_format": "`json_schema` (strict or not) or `json_object` constrain the answer "
    "with xgrammar; `text` is no constraint. A bad schema is a 400 naming the problem.",
    "structured_outputs": "vLLM's constraint object: exactly one of `json`, `regex`, "
    "`choice`, `grammar`, `json_object`.",
    "guided_json": "vLLM's older name for a JSON-schema constraint.",
    "guided_regex": "vLLM's older name for a regex constraint.",
    "guided_choice": "vLLM's older name: the answer is one of these strings.",
    "guided_grammar": "vLLM's older name for an EBNF grammar constraint.",
    # --- chat -------------------------------------------------------------------------
    "messages": "The conversation; at least one message.",
    "ChatMessage.role": "`developer` is treated as `system`.",
    "ChatMessage.content": "A string, or a list of `text` and `image_url` parts.",
    "ChatMessage.name": "Not passed to the chat template.",
    "ChatMessage.tool_calls": "An assistant turn's tool calls, passed to the chat template.",
    "ChatMessage.tool_call_id": "A tool turn's call id, passed to the chat template.",
    "TextPart.type": "`text`.",
    "TextPart.text": "The text.",
    "ImagePart.type": "`image_url`.",
    "ImagePart.image_url": "The image: see `ImageURL.url`.",
    "ImageURL.url": "`https://` (public hosts; `--allow-http-media`, "
    "`--allowed-media-domains`), `data:image/...;base64,` or `file://` under "
    "`--allowed-local-media-path`. JPEG, PNG, WebP, GIF and BMP only.",
    "ImageURL.detail": "Every image is tiled by the model's own rule.",
    "ChatCompletionRequest.logprobs": "`true`: each output token's raw logprob (before any "
    "control, temperature or filter).",
    "ChatCompletionRequest.top_logprobs": "Alternatives per token (at most 20); needs `logprobs`.",
    "user": "OpenAI's end-user id; nothing is logged by it.",
    "tools": "OpenAI's function tools; with `tool_choice` `required` or a named function the "
    "answer is constrained to valid calls on any model.",
    "tool_choice": '`"none"`, `"auto"` (needs a chat template with a `<tool_call>` format, '
    'else 400), `"required"` or a named function.',
    "parallel_tool_calls": "`false`: at most one call in a `required` answer.",
    "functions": "OpenAI's deprecated function calling: use `tools`.",
    "function_call": "OpenAI's deprecated function calling: use `tool_choice`.",
    "ChatCompletionRequest.best_of": "Ranking answers is served on /v1/completions only.",
    "prediction": "Predicted outputs are not implemented.",
    "audio": "No audio output.",
    "modalities": "Text output only.",
    # --- completions ------------------------------------------------------------------
    "CompletionRequest.prompt": "Text, token ids, or a list of either (at most 256 prompts); "
    "choice `prompt_index * n + i`.",
    "CompletionRequest.logprobs": "An integer (not chat's `true`): each output token's raw "
    "logprob and this many alternatives.",
    "CompletionRequest.echo": "The prompt before each answer (with `logprobs`, its tokens' "
    "logprobs too: lm-eval's loglikelihood).",
    "CompletionRequest.suffix": "Insertion is not implemented: a non-empty suffix is a 400.",
    "CompletionRequest.best_of": "Draw this many and keep the n of highest cumulative "
    "logprob; not streamable.",
    # --- /tokenize, /detokenize -------------------------------------------------------
    "TokenizeRequest.model": "Not checked: the server has one model.",
    "DetokenizeRequest.model": "Not checked: the server has one model.",
    "TokenizeRequest.prompt": "Raw text (special tokens as the checkpoint's tokenizer adds "
    "them); send exactly one of `prompt` and `messages`.",
    "TokenizeRequest.messages": "Chat messages through the template, images expanded to "
    "their token count.",
    "DetokenizeRequest.tokens": "Token ids, each in [0, vocab).",
}
