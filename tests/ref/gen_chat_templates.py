#!/usr/bin/env python3
"""gen_chat_templates.py: the expected tokens and loss masks of tokenize.py --chat, by transformers.

For each template directory under tests/fixtures/chat_templates/ (a published model's
tokenizer_config.json, see the README there), this script
  1. writes tokenizer.json: a byte-level BPE of a few hundred merges trained here on a fixed
     text (so it is small and deterministic), with the template's special tokens added;
  2. loads the directory with transformers' AutoTokenizer and, for every example of
     conversations.jsonl, writes to expected.json the ids of
     apply_chat_template(messages, tokenize=True) and, for each --loss-on mode, the loss mask
     by the spec's token-level rule, computed from apply_chat_template alone: for assistant
     message i, the tokens ids(messages[:i+1])[len(ids(messages[:i], add_generation_prompt=True)):]
     up to and including the last added token among them. A `text` example is
     Tokenizer.encode(text) (what the plain mode writes), all of it in the loss. An example the
     template refuses (raise_exception) is written as {"error": message}.
The masks are the spec's, before packing: the test clears a document's first loss bit itself.

Run with transformers 4.57 (and tokenizers, jinja2): /tmp/tfenv/bin/python tests/ref/gen_chat_templates.py
It writes the same bytes on every run (md5sum to check).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures", "chat_templates")

TEMPLATES = {  # directory: the special tokens its tokenizer.json adds, in id order
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "llama3.1": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],
    "qwen2.5": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
    "gemma2": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
}
# how each tokenizer's post-processor is set: Llama 3's prepends <|begin_of_text|> (so a text
# example starts with it), Qwen's trims offsets (tokenize.py must not trust trimmed offsets),
# Gemma's prepends <bos>
POST = {
    "llama3": ("bos", "<|begin_of_text|>"), "llama3.1": ("bos", "<|begin_of_text|>"),
    "qwen2.5": ("trim", None), "gemma2": ("bos", "<bos>"),
}
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TRAIN_TEXT = """\
First Citizen: Before we proceed any further, hear me speak.
All: Speak, speak. Café, naïve, 東京 and a snowman ☃ are text too.
Second Citizen: We are accounted poor citizens, the patricians good.
What authority surfeits on would relieve us: if they would yield us but the superfluity.
The user asks a question and the assistant answers it; a system prompt sets the tone.
You are a helpful assistant. Hello! How are you today? I am fine, thank you.
What is the capital of France? Paris is the capital of France.
Write a haiku about the sea. Waves fold into foam, the tide keeps its own counsel.

  Indented  text,	and blank lines between paragraphs:


  so that runs of spaces and newlines become tokens of their own.
"""

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Hello! How are you?"},
                  {"role": "assistant", "content": "I am fine, thank you."}]},
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Japan?"},
                  {"role": "assistant", "content": "Tokyo (東京)."}]},
    {"prompt": "Write a haiku about the sea.",
     "completion": "Waves fold into foam,\nthe tide keeps its own counsel,\ngulls argue the sky."},
    {"messages": [{"role": "user", "content": "  padded question \n"},
                  {"role": "assistant", "content": "\n\n  padded answer  \n"},
                  {"role": "user", "content": "Café? naïve? ☃"},
                  {"role": "assistant", "content": "Oui. Ja. Snowman: ☃!"}]},
    {"text": "A plain document: every token of it is learnt. Speak, speak."},
    {"messages": [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
                  {"role": "user", "content": "Three"}, {"role": "assistant", "content": "Four"},
                  {"role": "user", "content": "Five"}, {"role": "assistant", "content": "Six, and that is all."}]},
    {"messages": [{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "Colour of the sky?"},
                  {"role": "assistant", "content": "Blue"}]},
    {"prompt": "Count to three.", "completion": " 1, 2, 3 "},
    {"messages": [{"role": "user", "content": "Tell me a long story about citizens of Rome, please."},
                  {"role": "assistant", "content": "First Citizen: Before we proceed any further, hear me speak. "
                   "All: Speak, speak. Second Citizen: We are accounted poor citizens, the patricians good. "
                   "What authority surfeits on would relieve us: if they would yield us but the superfluity, "
                   "while it were wholesome, we might guess they relieved us humanely."}]},
    {"messages": [{"role": "user", "content": "Empty answer?"}, {"role": "assistant", "content": ""}]},
]


def build_tokenizer(name, specials):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    if name == "gemma2":  # GPT-2's split: whitespace at a render's end splits unlike mid-text
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # the split of Llama 3's and Qwen 2's tokenizer.json, then bytes
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TRAIN_TEXT] * 4, trainers.BpeTrainer(
        vocab_size=600, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(specials)
    kind, bos = POST[name]
    if kind == "trim":
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    else:
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tok.token_to_id(bos))])])
    path = os.path.join(FIXTURES, name, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(json.loads(tok.to_str()), ensure_ascii=False, separators=(",", ":")) + "\n")
    return Tokenizer.from_file(path)


def byte_starts(hf, ids):
    """The byte offset in the rendered text where each token starts (byte-level BPE: a token
    is its bytes through GPT-2's byte-to-character table; an added token its UTF-8 text)."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    added = {i: t.content for i, t in hf.added_tokens_decoder.items()}
    starts, at = [], 0
    for i, piece in zip(ids, hf.convert_ids_to_tokens(ids)):
        starts.append(at)
        at += len(added[i].encode()) if i in added else len(bytes(to_byte[c] for c in piece))
    return starts


straddled = []  # (template, example, message) where the spec's token rule is not defined


def expected(name, raw):
    """{mode: [{"ids", "loss"} or {"error"}]} for the conversations, by transformers."""
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(os.path.join(FIXTURES, name))
    added = set(hf.added_tokens_decoder)

    def ids(msgs, gen=False):
        return list(hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen))

    out = {"assistant": [], "last": [], "all": []}
    for ex in CONVERSATIONS:
        if "text" in ex:
            t = raw.encode(ex["text"]).ids
            for mode in out:
                out[mode].append({"ids": t, "loss": [1] * len(t)})
            continue
        msgs = ex.get("messages") or [{"role": "user", "content": ex["prompt"]},
                                      {"role": "assistant", "content": ex["completion"]}]
        try:
            full = ids(msgs)
        except TemplateError as e:
            for mode in out:
                out[mode].append({"error": str(e)})
            continue
        turns, starts = {}, byte_starts(hf, full)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before, upto = ids(msgs[:i], gen=True), ids(msgs[: i + 1])
            # the same span by characters: the tokens whose bytes start between the two renders' ends
            a, b = (len(hf.apply_chat_template(ms, tokenize=False, add_generation_prompt=g).encode())
                    for ms, g in ((msgs[:i], True), (msgs[: i + 1], False)))
            by_bytes = [k for k in range(len(full)) if a <= starts[k] < b]
            if upto[: len(before)] == before and full[: len(upto)] == upto:
                span = list(range(len(before), len(upto)))
                assert span == by_bytes, (name, ex, i)
            else:  # the ids before it are not a prefix: a token straddles the generation
                # prompt's end (Qwen's "\n", then content "\n..."), so take the span by bytes
                span = by_bytes
                straddled.append((name, CONVERSATIONS.index(ex), i))
            last = [k for k in span if full[k] in added]
            turns[i] = span[: span.index(last[-1]) + 1] if last else span
        for mode, chosen in (("assistant", list(turns)), ("last", list(turns)[-1:])):
            loss = [0] * len(full)
            for i in chosen:
                for k in turns[i]:
                    loss[k] = 1
            out[mode].append({"ids": full, "loss": loss})
        out["all"].append({"ids": full, "loss": [1] * len(full)})
    return out


def main():
    import transformers
    if not transformers.__version__.startswith("4.57"):
        print(f"warning: transformers {transformers.__version__}, the fixtures were made with 4.57",
              file=sys.stderr)
    with open(os.path.join(FIXTURES, "conversations.jsonl"), "w", encoding="utf-8") as f:
        for ex in CONVERSATIONS:
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    result = {}
    for name, specials in TEMPLATES.items():
        raw = build_tokenizer(name, specials)
        result[name] = expected(name, raw)
    with open(os.path.join(FIXTURES, "expected.json"), "w", encoding="utf-8") as f:
        f.write("{\n")
        for n, (name, modes) in enumerate(result.items()):
            f.write(f' "{name}": {{\n')
            for m, (mode, examples) in enumerate(modes.items()):
                f.write(f'  "{mode}": [\n')
                f.write(",\n".join("   " + json.dumps(e, ensure_ascii=False, separators=(",", ":"))
                                   for e in examples))
                f.write("\n  ]" + ("," if m < len(modes) - 1 else "") + "\n")
            f.write(" }" + ("," if n < len(result) - 1 else "") + "\n")
        f.write("}\n")
    for name, modes in result.items():
        errors = sum("error" in e for e in modes["all"])
        ntok = sum(len(e.get("ids", [])) for e in modes["all"])
        print(f"{name}: {len(CONVERSATIONS) - errors} examples, {ntok} tokens, {errors} refused")
    for name, ex, i in straddled:
        print(f"{name}: example {ex + 1}, message {i + 1}: the ids before it are not a prefix of "
              "the ids up to it; its span taken by bytes")


if __name__ == "__main__":
    main()
