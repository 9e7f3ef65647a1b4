"""chat_data.py: conversations to token lists with a loss flag per token (tokenize.py --chat).

An example is one JSONL line: {"messages": [{"role", "content"}, ...]} (OpenAI style, roles
system, user and assistant), {"prompt", "completion"} (a user and an assistant message), or
{"text"} (a plain document). A conversation is rendered with the model's chat template the
way transformers' apply_chat_template renders it (4.57: a Jinja2 ImmutableSandboxedEnvironment
with trim_blocks, lstrip_blocks and loopcontrols, its tojson filter, the raise_exception and
strftime_now globals, the tokenizer config's special tokens as variables, tools and documents
None, add_generation_prompt False) and encoded with Tokenizer.encode(rendered,
add_special_tokens=False), as apply_chat_template(tokenize=True) does. A text example is
encoded with Tokenizer.encode(text), as the plain mode encodes a file.

Loss flags (issue 32's data spec, "Loss mask"): for assistant
message i, its characters are those from the end of render(messages[:i],
add_generation_prompt=True) to the end of render(messages[:i+1]); both renders must be
prefixes of the whole conversation's render (a prefix-stable template), else the template
is refused and --loss-on all is the way out. The tokens starting in that span are cut after
the last added (special) token among them (the end-of-turn token: what a template writes
after it, Qwen's or Gemma's "\\n", is not learnt); without one the whole span counts.
`assistant` flags every assistant message, `last` the last one, `all` every token; a text
example is all loss. A document's first token is never a loss token (nothing precedes it).

Invariants: an Example's ids and loss have the same length; loss[0] == 0.
"""
import array
import bisect
import json
import os

ROLES = ("system", "user", "assistant")
# tokenizer_config.json keys transformers passes to the template (SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token", "additional_special_tokens")


class Fatal(Exception):
    """A problem with the tokenizer directory or its template: the whole run stops."""


class BadLine(Exception):
    """A problem with one input line; reason is the summary's key, str(self) the detail."""

    def __init__(self, reason, detail=None):
        super().__init__(detail or reason)
        self.reason = reason


class Example:
    """One example: ids (array('I'), 4 bytes a token) and loss (bytearray of 0/1, as long)."""

    def __init__(self, ids, loss):
        self.ids, self.loss = array.array("I", ids), loss


def token_text(value):
    """A special token as tokenizer_config.json writes it (a string or an AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_config(tok_dir):
    """tokenizer_config.json of tok_dir as a dict ({} when there is none)."""
    path = os.path.join(tok_dir, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}, path
    except (OSError, ValueError) as e:
        raise Fatal(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(config, dict):
        raise Fatal(f"{path}: not a JSON object")
    return config, path


def special_tokens(tok_dir, config):
    """The template's special-token variables, as transformers' special_tokens_map gives them:
    tokenizer_config.json's, then special_tokens_map.json's for the keys it leaves unset, then
    the names of extra_special_tokens; strings (lists for additional_special_tokens), set ones only."""
    try:
        with open(os.path.join(tok_dir, "special_tokens_map.json"), encoding="utf-8") as f:
            fallback = json.load(f)
    except (OSError, ValueError):
        fallback = {}
    fallback = fallback if isinstance(fallback, dict) else {}
    extra = config.get("extra_special_tokens")
    extra = extra if isinstance(extra, dict) else {}
    out = {}
    for key in SPECIAL_KEYS + tuple(extra):
        value = config.get(key) or fallback.get(key) or extra.get(key)
        if key == "additional_special_tokens" and isinstance(value, list):
            value = [t for t in map(token_text, value) if t]
        else:
            value = token_text(value)
        if value:
            out[key] = value
    return out


class Template:
    """A model's chat template, compiled as transformers compiles it."""

    def __init__(self, tok_dir):
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise Fatal("--chat needs the Python package 'jinja2'; install it with: "
                        "python3 -m pip install jinja2") from None
        self.jinja2 = jinja2
        config, config_path = read_config(tok_dir)
        source, self.path = self._source(tok_dir, config, config_path)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def strftime_now(fmt):
            import datetime
            return datetime.datetime.now().strftime(fmt)

        class Generation(jinja2.ext.Extension):
            """{% generation %}...{% endgeneration %}, which transformers' templates for
            assistant masks use: rendered as its body (the masks come from prefix renders)."""
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, Generation])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise Fatal(f"{self.path}: the chat template does not compile: {e}") from None
        self.variables = special_tokens(tok_dir, config)

    @staticmethod
    def _source(tok_dir, config, config_path):
        """The template text and the file it came from: chat_template.jinja beside the
        config wins (transformers loads it over the config's), else the config's
        chat_template, a string or a list of {name, template} (the one named default)."""
        jinja_path = os.path.join(tok_dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            try:
                with open(jinja_path, encoding="utf-8") as f:
                    return f.read(), jinja_path
            except (OSError, UnicodeDecodeError) as e:
                raise Fatal(f"cannot read {jinja_path}: {getattr(e, 'strerror', None) or e}") from None
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise Fatal(f"{config_path}: chat_template has no template named 'default' "
                            f"(it has {', '.join(map(str, named)) or 'none'})")
            source = named["default"]
        if not isinstance(source, str):
            raise Fatal(f"{config_path}: no chat_template (a conversation needs one; "
                        "plain text examples {\"text\": ...} do not)")
        return source, config_path

    def render(self, messages, add_generation_prompt):
        """The rendered conversation; BadLine when the template raises (its message kept)."""
        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.variables)
        except self.jinja2.exceptions.TemplateError as e:
            raise BadLine("template error", f"the chat template raised: {e}") from None
        except Exception as e:  # a template's own Python errors ('a' + none): the line's fault
            raise BadLine("template error", f"the chat template failed: {type(e).__name__}: {e}") from None


def parse_example(obj, need_assistant):
    """('messages', list) or ('text', str) from one decoded JSON line; BadLine when malformed.
    need_assistant: a conversation must have an assistant message (--loss-on assistant|last)."""
    if not isinstance(obj, dict):
        raise BadLine("not an object", f"not a JSON object but {type(obj).__name__}")
    kinds = [k for k in ("messages", "prompt", "text") if k in obj]
    if "completion" in obj and "prompt" not in obj:
        kinds.append("completion")
    if not kinds:
        raise BadLine("no messages, prompt/completion or text",
                      "neither 'messages', 'prompt'/'completion' nor 'text'")
    if len(kinds) > 1:
        raise BadLine("more than one kind", f"more than one of 'messages', 'prompt'/'completion' "
                      f"and 'text' ({', '.join(kinds)})")
    kind = kinds[0]
    if kind == "text":
        if not isinstance(obj["text"], str):
            raise BadLine("text not a string", "'text' is not a string")
        return "text", obj["text"]
    if kind in ("prompt", "completion"):
        for key in ("prompt", "completion"):
            if key not in obj:
                raise BadLine("prompt without completion", f"'{kinds[0]}' without '{key}'")
            if not isinstance(obj[key], str):
                raise BadLine("content not a string", f"'{key}' is not a string")
        return "messages", [{"role": "user", "content": obj["prompt"]},
                            {"role": "assistant", "content": obj["completion"]}]
    messages = obj["messages"]
    if not isinstance(messages, list):
        raise BadLine("messages not a list", "'messages' is not a list")
    if not messages:
        raise BadLine("empty conversation", "'messages' is empty")
    for n, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise BadLine("message not an object", f"message {n} is not an object")
        for key in ("role", "content"):
            if key not in m:
                raise BadLine(f"missing {key}", f"message {n} has no '{key}'")
        if m["role"] not in ROLES:
            raise BadLine("unknown role", f"message {n} has the unknown role {m['role']!r} "
                          f"(one of {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise BadLine("content not a string", f"message {n}: 'content' is not a string")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadLine("no assistant turn", "no assistant message (nothing to learn; "
                      "--loss-on all learns every token)")
    return "messages", messages


class Encoder:
    """Examples to token ids and loss flags with one tokenizer, template and --loss-on mode."""

    def __init__(self, tok, tok_dir, loss_on):
        from tokenizers import Tokenizer
        self.tok, self.tok_dir, self.loss_on = tok, tok_dir, loss_on
        # Offsets without the post-processor: ByteLevel's trim_offsets moves a token's start
        # past its leading spaces (an all-space token can start after the next one's). With
        # add_special_tokens=False the post-processor adds nothing, so the ids are the same.
        self.raw = Tokenizer.from_str(tok.to_str())
        self.raw.post_processor = None
        self.added = set(tok.get_added_tokens_decoder())
        self.template = None  # compiled on the first conversation: text-only input needs none
        self.checked = False

    def encode(self, obj):
        """An Example from one decoded JSON line; BadLine when the line is wrong."""
        kind, value = parse_example(obj, self.loss_on != "all")
        if kind == "text":
            ids = self.tok.encode(value).ids
            return Example(ids, bytearray(b"\x01") * len(ids))
        if self.template is None:
            self.template = Template(self.tok_dir)
        full = self.template.render(value, False)
        enc = self.raw.encode(full, add_special_tokens=False)
        ids = enc.ids
        if not self.checked:  # once: the ids are the tokenizer's own (what transformers gives)
            if ids != self.tok.encode(full, add_special_tokens=False).ids:
                raise Fatal(f"{self.tok_dir}: the tokenizer's post-processor changes the ids of "
                            "encode(add_special_tokens=False); the assistant tokens cannot be found")
            self.checked = True
        if self.loss_on == "all":
            return Example(ids, bytearray(b"\x01") * len(ids))
        loss = bytearray(len(ids))
        starts = [s for s, _ in enc.offsets]  # untrimmed, so in order
        turns = [i for i, m in enumerate(value) if m["role"] == "assistant"]
        for i in turns[-1:] if self.loss_on == "last" else turns:
            start, end = self.span(value, i, full)
            lo, hi = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
            cut = [k for k in range(lo, hi) if ids[k] in self.added]
            loss[lo: cut[-1] + 1 if cut else hi] = b"\x01" * ((cut[-1] + 1 if cut else hi) - lo)
        return Example(ids, loss)

    def span(self, messages, i, full):
        """[start, end): the characters of assistant message i in the conversation's render."""
        before = self.template.render(messages[:i], True)
        upto = self.template.render(messages[: i + 1], False)
        if not (full.startswith(before) and full.startswith(upto) and len(before) <= len(upto)):
            raise Fatal(f"the chat template of {self.template.path} is not prefix-stable: "
                        f"rendering the messages before message {i + 1} with the generation prompt, "
                        "or those up to it, does not give a prefix of the whole conversation, so "
                        "its assistant tokens cannot be found; --loss-on all learns every token")
        return len(before), len(upto)


class FirstFit:
    """First-fit bin choice in O(log bins): a segment tree of each bin's free room."""

    def __init__(self, size):
        self.size, self.n, self.room = size, 0, [0, 0]  # room: the tree, leaves at [cap, 2*cap)

    def place(self, length):
        """The index of the first bin (in creation order) with room for length tokens, taking
        the room; a new bin when none has it."""
        cap = len(self.room) // 2
        if self.room[1] < length:  # no bin has room: open one, doubling the tree when full
            if self.n == cap:
                old, cap = self.room, cap * 2
                self.room = [0] * (2 * cap)
                self.room[cap: cap + self.n] = old[len(old) // 2: len(old) // 2 + self.n]
                for k in range(cap - 1, 0, -1):
                    self.room[k] = max(self.room[2 * k], self.room[2 * k + 1])
            k, self.n = cap + self.n, self.n + 1
            self._set(k, self.size)
        k = 1
        while k < cap:  # descend to the leftmost leaf with room
            k = 2 * k if self.room[2 * k] >= length else 2 * k + 1
        self._set(k, self.room[k] - length)
        return k - cap

    def _set(self, k, value):
        self.room[k] = value
        while k > 1:
            k //= 2
            self.room[k] = max(self.room[2 * k], self.room[2 * k + 1])


def trim(example, size, overlong):
    """The example as it is packed, or the reason it is dropped: longer than size tokens, it
    keeps its first size tokens (overlong "truncate") or is dropped ("drop", "too long"); its
    first token's loss is cleared; with no loss token left it is dropped ("no loss token").
    A kept example that was cut says so ("truncated")."""
    cut = None
    if len(example.ids) > size:
        if overlong == "drop":
            return None, "too long"
        example = Example(example.ids[:size], example.loss[:size])
        cut = "truncated"
    if example.loss:
        example.loss[0] = 0
    if not any(example.loss):
        return None, "no loss token"
    return example, cut


def pack(examples, size, pad):
    """Bins of exactly size tokens: each example (at most size tokens) goes first-fit, in input
    order, into the first bin with room, its first token starting a document; a bin's unused
    room is pad tokens, a document of its own with no loss. A list, in creation order, of
    (ids array('I'), loss bytearray, start bytearray), each of size entries."""
    fit, bins = FirstFit(size), []
    for ex in examples:
        b = fit.place(len(ex.ids))
        if b == len(bins):
            bins.append((array.array("I"), bytearray(), bytearray()))
        ids, loss, start = bins[b]
        ids.extend(ex.ids)
        loss += ex.loss
        start += b"\x01" + bytes(len(ex.ids) - 1)
    for ids, loss, start in bins:
        room = size - len(ids)
        if room:
            ids.extend([pad] * room)
            loss += bytes(room)
            start += b"\x01" + bytes(room - 1)
    return bins
