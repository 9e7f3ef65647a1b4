#!/tmp/tfenv/bin/python
"""Float64 reference for ferry's chat training (issue 32): tokenized with a Llama 3 template,
packed into 512-token bins, trained 3 steps; the losses transformers gives unpacked.

Writes tests/fixtures/chat_llama3/ (or --out):
  tokenizer.json, tokenizer_config.json   a byte-level BPE of 500 entries trained here with
        `tokenizers` on the English text below (Llama 3's pre-tokenizer regex, its BOS
        post-processor), plus the five Llama 3 special tokens as added tokens 500..504;
        the config names bos <|begin_of_text|>, eos <|eot_id|>, pad <|end_of_text|> and
        carries Meta-Llama-3-8B-Instruct's chat template verbatim (TEMPLATE)
  config.json, generation_config.json, model.safetensors
        a random LlamaForCausalLM saved by transformers (V=512, C=64, L=2, NH=4, NKV=2,
        F=96, 512 positions, rope_theta 500000, untied, F32; init INIT_STD, norms 1 + N(0, 0.1))
  conversations.jsonl    31 {"messages": [...]} lines from a seeded generator (make_conversations)
  chat_llama3_ref.json   the reference: per step loss, grad_norm (before clipping) and the
        number of target tokens, the bins (examples per bin, in order), the expected token
        stream and mask bits (sha256), eval figures of the initial model, the AdamW settings
        and the command lines chat_test.sh runs

The reference does not use scripts/tokenize.py. For each conversation,
ids = tokenizer.apply_chat_template(messages, tokenize=True) (transformers), and the loss
labels are -100 but on each assistant message's tokens by the spec's token-level rule:
ids(msgs[:i+1])[len(ids(msgs[:i], add_generation_prompt=True)):] up to and including the
last special token (asserted: a prefix, and exactly content + <|eot_id|> for this template).
Conversations are packed first-fit, in input order, into bins of SEQ tokens (pack). ferry's
step s trains bins 2s and 2s+1 (batch 2, or batch 1 x 2 micro-batches, or 2 ranks). The step's
loss, as transformers computes chat fine-tuning: each conversation of the step's bins run ALONE
(unpacked) through LlamaForCausalLM in float64 (eager attention, transformers' float32 upcasts
promoted to float64: check_hf_load.set_exact), cross-entropy of the shifted labels summed, over
the step's number of labelled tokens; backward, clip_grad_norm_(1.0), torch.optim.AdamW
(lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on 2-D tensors, 0 on norms).

Self-checks before writing: the model's own labels= loss equals the summed one per
conversation; step 1 computed PACKED (the two bins as ferry sees them: positions restarting at
each document, targets from the stream and the spec's LOSS/START bits) with a 4-D mask that
blocks attention across documents, and again with transformers' own packed-sequence detection
from position_ids, equals the unpacked loss to 1e-12 and its gradient to 1e-10; the
alternatives a wrong implementation would compute (no document mask, every token a target,
the last assistant message only, labels one token late, a mean of per-conversation means)
each move the step-1 loss by more than 1e-3; a float32 run of the same 3 steps
(transformers' stock float32) estimates what fp32 arithmetic alone does to the figures.

Byte-identical across runs (one CPU thread, float64). About 10 s:
    /tmp/tfenv/bin/python tests/ref/gen_chat_ref.py [--out DIR]
"""

import argparse
import hashlib
import json
import os
import random
import shutil
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import check_hf_load as chk  # noqa: E402
from gen_masked_data import bits  # noqa: E402 (the .mask bit planes, packed as the spec says)

DT = torch.float64
NAME = "chat_llama3"
SEQ, BATCH, STEPS = 512, 2, 3
LR, BETA1, BETA2, EPS, WD, CLIP = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0
BPE_SIZE = 500         # byte alphabet (256) + 244 merges
VOCAB = 512             # model rows: the 505 tokens rounded up to a multiple of 64
SEED = 3232
NCONV = 31
INIT_STD = {"embed": 0.3, "qk": 0.2, "head": 0.15, "other": 0.1}
SHARD_MAGIC, SHARD_VERSION = 20240520, 1
MASK_MAGIC, MASK_VERSION = 20261203, 1

# Meta-Llama-3-8B-Instruct's tokenizer_config.json "chat_template", as published (with the
# add_generation_prompt guard of the May 2024 revision, the one that also set eos <|eot_id|>)
TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
            "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
            "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
            "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
            "{% endif %}")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
BOS, PAD, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
# Llama 3's pre-tokenizer split (tokenizer.json of Meta-Llama-3-8B)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# ---------------------------------------------------------------- the text

SYSTEMS = [
    "You are a helpful assistant. Answer briefly and clearly.",
    "You are a patient cooking teacher who explains every step.",
    "You are a travel guide. Keep your answers short and practical.",
    "You are a careful programming tutor. Prefer small examples.",
]

# topic: (user questions, assistant sentences)
TOPICS = {
    "cooking": (
        ["How long should I boil an egg?", "What can I cook with rice and beans?",
         "Why does my bread not rise?", "Can you suggest a quick soup for a cold evening?",
         "Is it safe to freeze cooked pasta?"],
        ["Put the egg in boiling water for about nine minutes.",
         "Cool it in cold water so the shell comes off easily.",
         "Rice and beans make a good meal with onions, garlic and a little spice.",
         "Bread needs warm water, fresh yeast and enough time to rise.",
         "If the kitchen is cold, let the dough rest a little longer.",
         "A simple soup starts with onions, carrots and a good stock.",
         "Cooked pasta freezes well if you add a little oil first.",
         "Taste the food often and add salt at the end.",
         "A crêpe or a café au lait is easy to make at home, too."]),
    "travel": (
        ["What should I pack for a week in the mountains?", "How do I get from the airport to the city?",
         "Which season is best for a trip to Tokyo?", "Do I need cash when I travel?",
         "How can I sleep better on a long flight?"],
        ["Pack warm layers, good shoes and a rain jacket.",
         "The train is usually the fastest way into the city.",
         "Spring and autumn are the best seasons for a visit to 東京.",
         "Most shops take cards, but a little cash is useful for small places.",
         "Drink water, walk around the cabin and keep a light blanket with you.",
         "Check the weather the day before you leave.",
         "Keep a copy of your passport in a safe place.",
         "In Zürich you can say Grüezi, and in Paris a simple bonjour is polite."]),
    "programming": (
        ["How do I reverse a list in Python?", "What is a pointer in C?",
         "Why does my loop never end?", "How should I name my variables?",
         "What is the difference between a list and a tuple?"],
        ["In Python you can write items.reverse() or use items[::-1] for a copy.",
         "A pointer holds the address of another value in memory.",
         "A loop never ends when its condition never becomes false.",
         "Print the counter inside the loop to see what changes.",
         "Good names say what a value means, not how it is stored.",
         "A list can change after you make it, and a tuple cannot.",
         "Write a small test first, then make it pass.",
         "Read the error message from the top; the first line is often the real cause."]),
    "weather": (
        ["Will it rain tomorrow?", "Why is the sky blue?", "What makes a storm?",
         "How cold does it get at night in the desert?"],
        ["I cannot see the forecast, but a local weather service can tell you.",
         "The sky looks blue because air scatters blue light more than red light.",
         "A storm forms when warm wet air rises quickly and cools.",
         "Deserts can get very cold at night, sometimes close to freezing.",
         "Clouds hold the heat of the day like a blanket.",
         "Take an umbrella if the clouds look dark in the morning 🙂."]),
    "math": (
        ["What is a prime number?", "How do I add two fractions?",
         "What is the area of a circle?", "Why can we not divide by zero?"],
        ["A prime number has exactly two divisors: one and itself.",
         "Seven, eleven and thirteen are primes; nine is not.",
         "To add fractions, give them the same denominator first.",
         "The area of a circle is pi times the radius squared.",
         "For a radius of 2 the area is about 12.57.",
         "Division by zero has no answer that would make the rules of arithmetic work.",
         "It helps to check the result with a small example."]),
    "history": (
        ["Who built the pyramids?", "When did people start writing?",
         "Why did the Roman empire fall?", "What was the printing press good for?"],
        ["The pyramids were built by skilled workers, not by slaves, as people once thought.",
         "Writing began more than five thousand years ago in Mesopotamia.",
         "Historians name many causes for the fall of Rome, from money to war.",
         "The printing press made books cheap, so ideas could travel fast.",
         "Old letters and records tell us how ordinary people lived.",
         "Every answer in history starts with a careful look at the sources."]),
}
FOLLOW_UPS = ["Thanks! Can you say more?", "Could you give me an example?", "Why is that?",
              "And what should I avoid?", "That helps. One more question, please.",
              "Ok, and how long does that take?"]
CLOSINGS = ["Thank you, that is all.", "Great, thanks a lot!", "Merci, très utile."]

EXTRA_TEXT = """The quick brown fox jumps over the lazy dog while the children watch from the window.
A good answer is short, true and kind. Questions help us learn, and answers help us decide.
The teacher said that every step of a recipe matters, from the first onion to the last spoon of salt.
Travel is easier when you plan the day, carry water and leave room for surprises.
Programs are read more often than they are written, so write them for the reader.
The weather changes quickly in the mountains; the sun, the rain and the wind can all come in one afternoon.
Numbers have patterns: even and odd, prime and composite, small and very large.
History is the story of people who lived before us and of what they left behind.
"""


def bpe_corpus():
    """The lines the BPE is trained on: every sentence the conversations draw from."""
    lines = list(SYSTEMS) + FOLLOW_UPS + CLOSINGS + EXTRA_TEXT.splitlines()
    for qs, ans in TOPICS.values():
        lines += qs + ans
    # the role names and the blank line of the template's headers, as often as in real chats
    return lines + ["system\n\n", "user\n\n", "assistant\n\n"] * 40


def make_conversations():
    """NCONV conversations from a seeded generator: some with a system message, 1 to 4
    assistant turns, answers of 1 to 5 sentences; conversation 5 ends with a user turn
    (nothing after the last assistant message is a target), one user message has
    surrounding whitespace (the template trims it)."""
    rng = random.Random(SEED)
    topics = sorted(TOPICS)
    out = []
    for c in range(NCONV):
        topic = topics[rng.randrange(len(topics))]
        qs, ans = TOPICS[topic]
        msgs = []
        if rng.random() < 0.4:
            msgs.append({"role": "system", "content": SYSTEMS[rng.randrange(len(SYSTEMS))]})
        # lengths from ~30 to ~300 tokens: mostly short, some long
        turns = rng.choice([1, 1, 1, 1, 2, 2, 3, 4])
        for t in range(turns):
            q = qs[rng.randrange(len(qs))] if t == 0 else FOLLOW_UPS[rng.randrange(len(FOLLOW_UPS))]
            msgs.append({"role": "user", "content": q})
            k = rng.choice([1, 1, 1, 2, 2, 3]) if turns < 3 else rng.choice([1, 1, 1, 2])
            msgs.append({"role": "assistant", "content": " ".join(rng.sample(ans, min(k, len(ans))))})
        if c == 5:
            msgs.append({"role": "user", "content": CLOSINGS[rng.randrange(len(CLOSINGS))]})
        if c == 9:
            first_user = next(m for m in msgs if m["role"] == "user")
            first_user["content"] = "  " + first_user["content"] + "\n"
        out.append({"messages": msgs})
    return out


# ---------------------------------------------------------------- tokenizer and model

def build_tokenizer(out):
    """Byte-level BPE (Llama 3 pre-tokenizer and BOS post-processor) + the special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(bpe_corpus(), trainers.BpeTrainer(
        vocab_size=BPE_SIZE, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == BPE_SIZE, tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert [ids[s] for s in SPECIALS] == list(range(BPE_SIZE, BPE_SIZE + len(SPECIALS))), ids
    # as Llama 3's tokenizer.json: a plain encode() adds <|begin_of_text|> (apply_chat_template
    # encodes with add_special_tokens=False, the template writes the BOS itself)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=BOS + " $A", pair=BOS + " $A:0 " + BOS + ":1 $B:1",
                                      special_tokens=[(BOS, ids[BOS])])])
    tok.save(os.path.join(out, "tokenizer.json"))
    added = {str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for s in SPECIALS}
    cfg = {"added_tokens_decoder": added, "bos_token": BOS, "chat_template": TEMPLATE,
           "clean_up_tokenization_spaces": True, "eos_token": EOT, "pad_token": PAD,
           "model_input_names": ["input_ids", "attention_mask"], "model_max_length": SEQ,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return ids


def hf_config(ids):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        rope_theta=500000.0, rope_scaling=None, rms_norm_eps=1e-5, tie_word_embeddings=False,
        hidden_act="silu", attention_bias=False, mlp_bias=False, initializer_range=0.02,
        bos_token_id=ids[BOS], eos_token_id=ids[EOT], pad_token_id=None, use_cache=False,
        torch_dtype="float32")


def write_model(out, ids):
    """A LlamaForCausalLM saved by transformers, every tensor drawn here (seed SEED)."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(hf_config(ids))
    g = torch.Generator()
    g.manual_seed(SEED + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                assert n.endswith("norm.weight"), n
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                kind = ("embed" if "embed_tokens" in n else "head" if n == "lm_head.weight"
                        else "qk" if n.endswith(("q_proj.weight", "k_proj.weight")) else "other")
                p.copy_(INIT_STD[kind] * torch.randn(p.shape, generator=g))
    model.save_pretrained(out, safe_serialization=True)


def load_model(out, dtype):
    from transformers import LlamaForCausalLM
    model, info = LlamaForCausalLM.from_pretrained(out, torch_dtype=dtype, output_loading_info=True,
                                                   attn_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.train()   # no dropout in Llama; train() only so nothing differs from a training run
    return model


# ---------------------------------------------------------------- examples, labels, bins

def render(tok, msgs, special, eot):
    """(ids, labels) of one conversation: labels -100 but on each assistant message's
    tokens, by the spec's token-level rule; special is the set of added tokens' ids."""
    ids = tok.apply_chat_template(msgs, tokenize=True)
    labels = [-100] * len(ids)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        assert i > 0, "an assistant message first has no prefix to extend"
        prefix = tok.apply_chat_template(msgs[:i], tokenize=True, add_generation_prompt=True)
        full = tok.apply_chat_template(msgs[:i + 1], tokenize=True)
        assert full[:len(prefix)] == prefix, "prefix property"
        assert ids[:len(full)] == full, "a conversation's ids extend each of its prefixes"
        span = full[len(prefix):]
        last = max(j for j, t in enumerate(span) if t in special)
        span = span[:last + 1]
        # for this template: exactly the trimmed content and <|eot_id|>
        assert span == tok.encode(m["content"].strip(), add_special_tokens=False) + [eot]
        for j in range(len(prefix), len(prefix) + len(span)):
            labels[j] = ids[j]
    return ids, labels


def pack(lengths, S):
    """First-fit in input order: each example goes to the first bin (in creation order)
    with room for it, else to a new bin. Returns the bins as lists of example indices."""
    bins, room = [], []
    for e, n in enumerate(lengths):
        assert 0 < n <= S
        for b in range(len(bins)):
            if room[b] >= n:
                bins[b].append(e)
                room[b] -= n
                break
        else:
            bins.append([e])
            room.append(S - n)
    return bins


def stream(examples, bins, pad_id):
    """The packed token stream ferry reads (bins in order, each padded to SEQ with a pad
    document, then one pad token), with the spec's LOSS and START bits and the position
    of each token in its document."""
    toks, loss, start, pos = [], [], [], []
    for b in bins:
        for e in b:
            ids, labels = examples[e]
            toks += ids
            loss += [int(lab != -100) for lab in labels]
            start += [1] + [0] * (len(ids) - 1)
            pos += list(range(len(ids)))
        n = SEQ - sum(len(examples[e][0]) for e in b)
        if n:
            toks += [pad_id] * n
            loss += [0] * n
            start += [1] + [0] * (n - 1)
            pos += list(range(n))
    toks.append(pad_id)
    loss.append(0)
    start.append(1)
    pos.append(0)
    assert len(toks) == len(bins) * SEQ + 1
    assert not any(lb and st for lb, st in zip(loss, start))
    return toks, loss, start, pos


def sha256(b):
    return hashlib.sha256(b).hexdigest()


# ---------------------------------------------------------------- losses

def example_loss_sum(model, ids, labels):
    """Sum of the cross-entropies of the shifted labels (transformers' causal LM
    convention: position t predicts labels[t + 1]) and their count."""
    x = torch.tensor([ids])
    y = torch.tensor(labels[1:])
    logits = model(input_ids=x, use_cache=False).logits[0, :-1]
    s = F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
    return s, int((y != -100).sum())


def step_loss(model, examples, bins, s):
    """The step's loss: every target token of bins 2s, 2s+1, each conversation alone."""
    total, count = 0.0, 0
    for b in bins[BATCH * s: BATCH * s + BATCH]:
        for e in b:
            ls, n = example_loss_sum(model, *examples[e])
            total = total + ls
            count += n
    return total / count, count


def packed_loss(model, st, s, how):
    """Step s's loss computed the way ferry sees the data: the step's bins as rows of the
    stream, target t + 1 for position t, counted when LOSS[t + 1] and not START[t + 1].
    how: "mask4d" positions restart per document and a 4-D additive mask keeps attention
    inside a document; "posids" positions only (transformers detects the packing);
    "nodocs" one causal sequence per bin, positions 0..S-1 (what a missing document mask
    gives)."""
    toks, loss, start, pos = st
    total, count = 0.0, 0
    for r in range(BATCH * s, BATCH * s + BATCH):
        a = r * SEQ
        x = torch.tensor([toks[a:a + SEQ]])
        y = torch.tensor(toks[a + 1:a + SEQ + 1])
        keep = torch.tensor([bool(loss[t + 1] and not start[t + 1]) for t in range(a, a + SEQ)])
        doc = torch.tensor(start[a:a + SEQ]).cumsum(0)
        kw = {}
        if how in ("mask4d", "posids"):
            kw["position_ids"] = torch.tensor([pos[a:a + SEQ]])
        if how == "mask4d":
            ok = (doc[:, None] == doc[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
            m = torch.zeros(SEQ, SEQ, dtype=DT).masked_fill(~ok, float("-inf"))
            kw["attention_mask"] = m[None, None]
        logits = model(input_ids=x, use_cache=False, **kw).logits[0]
        total = total + F.cross_entropy(logits[keep], y[keep], reduction="sum")
        count += int(keep.sum())
    return total / count, count


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def train(model, examples, bins):
    """STEPS AdamW steps; per step (loss, norm before clipping, target count)."""
    params = [p for _, p in model.named_parameters()]
    decay = [p for p in params if p.dim() == 2]
    no_decay = [p for p in params if p.dim() != 2]
    assert all(p.dim() == 1 for p in no_decay)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(BETA1, BETA2), eps=EPS)
    out = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        lv, n = step_loss(model, examples, bins, s)
        lv.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP).item()
        assert norm > CLIP, "clipping not active at step %d (norm %r)" % (s + 1, norm)
        opt.step()
        out.append((lv.item(), norm, n))
    return out


# ---------------------------------------------------------------- self-checks

def rel(a, b):
    return abs(a - b) / abs(b)


def check_step1(model, examples, bins, st):
    """Packed == unpacked (loss 1e-12, gradient 1e-10), the model's own labels= loss ==
    the summed one, and the wrong answers are far from the right one. Returns figures
    for the JSON."""
    for ids, labels in examples[:8]:
        ls, n = example_loss_sum(model, ids, labels)
        own = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), use_cache=False).loss
        assert rel(ls.item() / n, own.item()) <= 1e-13, (ls.item() / n, own.item())
    ref, count = step_loss(model, examples, bins, 0)
    g_ref = grads_of(model, ref)
    res = {"loss": ref.item(), "count": count}
    for how in ("mask4d", "posids"):
        lp, cp = packed_loss(model, st, 0, how)
        assert cp == count, (how, cp, count)
        r = rel(lp.item(), ref.item())
        assert r <= 1e-12, (how, lp.item(), ref.item())
        g = grads_of(model, lp)
        gerr = max(((g[n] - g_ref[n]).abs().max() / g_ref[n].abs().max()).item() for n in g)
        assert gerr <= 1e-10, (how, gerr)
        res["packed_" + how] = {"loss": lp.item(), "loss_rel_diff": r, "grad_max_rel_diff": gerr}
    model.zero_grad(set_to_none=True)

    # what wrong implementations give
    with torch.no_grad():
        alt = {"no_document_mask": packed_loss(model, st, 0, "nodocs")[0].item()}
        ex0 = [examples[e] for b in bins[:BATCH] for e in b]

        def relabel(fn):
            t, c = 0.0, 0
            for ids, labels in ex0:
                ls, n = example_loss_sum(model, ids, fn(ids, labels))
                t, c = t + ls.item(), c + n
            return t / c

        alt["every_token"] = relabel(lambda ids, labels: list(ids))
        alt["one_token_late"] = relabel(lambda ids, labels: [-100] + labels[:-1])

        def last_only(ids, labels):
            out, j = list(labels), len(labels) - 1
            while j >= 0 and labels[j] == -100:
                j -= 1
            while j >= 0 and labels[j] != -100:
                j -= 1
            return [-100] * (j + 1) + out[j + 1:]

        alt["last_assistant_only"] = relabel(last_only)
        means = [example_loss_sum(model, i, lab) for i, lab in ex0]
        alt["mean_of_conversation_means"] = sum(ls.item() / n for ls, n in means) / len(means)
    for k, v in alt.items():
        assert rel(v, ref.item()) > 1e-3, (k, v, ref.item())
    res["wrong_answers"] = alt
    return res


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.normpath(os.path.join(HERE, "..", "fixtures", NAME)))
    args = ap.parse_args()
    out = os.path.normpath(args.out)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)

    import transformers
    from transformers import AutoTokenizer
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    # ---- the directory
    ids = build_tokenizer(out)
    write_model(out, ids)
    convs = make_conversations()
    with open(os.path.join(out, "conversations.jsonl"), "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == TEMPLATE
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOT, PAD)
    assert len(tok) == BPE_SIZE + len(SPECIALS) <= VOCAB
    assert tok("hi")["input_ids"][0] == ids[BOS]        # the post-processor adds BOS ...
    special_ids = {s: ids[s] for s in SPECIALS}
    special_set = set(special_ids.values())

    # ---- examples, labels, bins
    with open(os.path.join(out, "conversations.jsonl"), encoding="utf-8") as f:
        read = [json.loads(line) for line in f]
    assert read == convs
    examples = [render(tok, c["messages"], special_set, ids[EOT]) for c in read]
    # ... apply_chat_template does not: one BOS, the template's
    assert all(e[0][0] == ids[BOS] and e[0].count(ids[BOS]) == 1 for e in examples)
    lengths = [len(e[0]) for e in examples]
    assert max(lengths) <= SEQ
    bins = pack(lengths, SEQ)
    assert BATCH * STEPS <= len(bins) <= 8, len(bins)
    st = stream(examples, bins, ids[PAD])
    assert sum(st[1]) == sum(sum(lab != -100 for lab in e[1]) for e in examples)
    assert any(ord(ch) > 127 for c in read for m in c["messages"] for ch in m["content"])

    # ---- float64, transformers' upcasts promoted
    chk.set_exact(True)
    model = load_model(out, DT)
    step1 = check_step1(model, examples, bins, st)
    with torch.no_grad():
        per_bin = []
        for b in bins:
            t, c = 0.0, 0
            for e in b:
                ls, n = example_loss_sum(model, *examples[e])
                t, c = t + ls.item(), c + n
            per_bin.append((t, c))
    runs = train(model, examples, bins)
    assert rel(runs[0][0], step1["loss"]) <= 1e-15 and runs[0][2] == step1["count"]
    chk.set_exact(False)

    # ---- the same in transformers' float32: what fp32 rounding alone does
    m32 = load_model(out, torch.float32)
    runs32 = train(m32, examples, bins)
    fp32 = {"loss_rel_diff": [rel(a[0], b[0]) for a, b in zip(runs32, runs)],
            "grad_norm_rel_diff": [rel(a[1], b[1]) for a, b in zip(runs32, runs)]}

    fix = "tests/fixtures/" + NAME
    opt = ("--lr 1e-3 --lr-schedule const --warmup 0 --weight-decay 0.1 --beta1 0.9 --beta2 0.95 "
           "--eps 1e-8 --clip 1.0")
    train_cmd = ("ferry train --init %s --data \"$DIR/chat_train_*.bin\" --seq %d --steps %d %s "
                 "--device cpu --quiet" % (fix, SEQ, STEPS, opt))
    eval_cmd = "ferry eval --init %s --data \"$DIR/chat_train_*.bin\" --seq %d --device cpu --quiet" % (fix, SEQ)
    commands = {
        "tokenize": "python3 scripts/tokenize.py --tokenizer %s --chat --seq %d --out $DIR/chat "
                    "%s/conversations.jsonl" % (fix, SEQ, fix),
        "train": train_cmd + " --batch %d --metrics $DIR/b2.jsonl" % BATCH,
        "train_grad_accum": train_cmd + " --batch 1 --grad-accum %d --threads 1 --metrics $DIR/ga.jsonl" % BATCH,
        "train_mpi": "mpirun -np %d --oversubscribe " % BATCH + train_cmd
                     + " --batch 1 --threads 1 --metrics $DIR/mpi.jsonl",
        "eval_first_batch": eval_cmd + " --batch %d --batches 1" % BATCH,
        "eval_all_bins": eval_cmd + " --batch 1 --batches %d" % len(bins),
    }
    tb, tc = sum(t for t, _ in per_bin), sum(c for _, c in per_bin)
    ref = {
        "model": NAME,
        "seq": SEQ, "batch": BATCH, "steps": STEPS,
        "adamw": {"lr": LR, "beta1": BETA1, "beta2": BETA2, "eps": EPS, "weight_decay": WD,
                  "weight_decay_on": "2-D tensors", "clip": CLIP, "schedule": "const", "warmup": 0},
        "losses": [r[0] for r in runs],
        "grad_norms": [r[1] for r in runs],
        "target_tokens": [r[2] for r in runs],
        "bins": bins,
        "bin_tokens": [sum(lengths[e] for e in b) for b in bins],
        "example_tokens": lengths,
        "example_targets": [sum(lab != -100 for lab in e[1]) for e in examples],
        "stream": {"tokens": len(st[0]), "dtype": "uint16", "pad_id": ids[PAD],
                   "tokens_sha256": sha256(b"".join(t.to_bytes(2, "little") for t in st[0])),
                   "loss_bits_sha256": sha256(bits(st[1])), "start_bits_sha256": sha256(bits(st[2])),
                   "loss_bits": sum(st[1]), "start_bits": sum(st[2])},
        "eval": {"first_batch_loss": step1["loss"],
                 "all_bins_loss": tb / tc, "all_bins_targets": tc,
                 "per_bin_loss": [t / c for t, c in per_bin], "per_bin_targets": [c for _, c in per_bin]},
        "step1_checks": step1,
        "fp32_estimate": fp32,
        "commands": commands,
        "special_ids": special_ids,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    with open(os.path.join(out, NAME + "_ref.json"), "w") as f:
        json.dump(ref, f, indent=1, ensure_ascii=False)
        f.write("\n")

    print("bins (%d): %s" % (len(bins), " ".join("%d:%s" % (sum(lengths[e] for e in b), b) for b in bins)))
    print("examples: %d, tokens %d..%d" % (len(examples), min(lengths), max(lengths)))
    for s, (lv, nv, n) in enumerate(runs):
        print("step %d: loss %.12f grad_norm %.12f targets %d" % (s + 1, lv, nv, n))
    print("packed vs unpacked, step 1: loss %.1e / %.1e, grad %.1e / %.1e" % (
        step1["packed_mask4d"]["loss_rel_diff"], step1["packed_posids"]["loss_rel_diff"],
        step1["packed_mask4d"]["grad_max_rel_diff"], step1["packed_posids"]["grad_max_rel_diff"]))
    print("wrong answers (step 1 %.6f): %s" % (step1["loss"], " ".join(
        "%s=%.6f" % kv for kv in step1["wrong_answers"].items())))
    print("fp32 vs fp64: loss %s grad_norm %s" % (
        " ".join("%.1e" % v for v in fp32["loss_rel_diff"]),
        " ".join("%.1e" % v for v in fp32["grad_norm_rel_diff"])))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
