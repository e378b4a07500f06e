"""One JSONL line or dataset row → one sample: format detection (``messages``, ``turns``,
``prompt_completion``, ``prompt``, ``text``) and the checks of each format's fields
(:class:`_JsonlParser`; the table of formats is in :mod:`kvcal.corpus`)."""

from __future__ import annotations

import shlex

from kvcal.corpus.base import _EXAMPLE, _err, _one_line
from kvcal.corpus.encode import _has_chat_template, _render_chat, _type_name

#: JSONL formats, in the order their keys are looked for on a line.
#: Roles a ``messages`` record may use (OpenAI chat roles; Llama 3's ``ipython`` tool role).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
JSONL_FORMATS = ("messages", "turns", "prompt_completion", "prompt", "text")
ACCEPTED_FIELDS = 'text, prompt, prompt + completion|response, messages, turns'


class _JsonlParser:
    """Validates one JSONL record / dataset row and returns ``(format, text, add_special_tokens)``.

    ``tokenizer=None``: validation only (:func:`check_corpus`): chat samples are not rendered and
    come back as ``""``. ``text_field`` / ``messages_field``: the record's key holding the raw
    text / the conversation (then no other field is looked at). Counts non-text content parts
    dropped (``dropped``, per type) and assistant turns with ``tool_calls`` (``tool_call_turns``).
    """

    def __init__(self, path: str, tokenizer, text_field: str | None = None, messages_field: str | None = None):
        self.path = path
        self.tok = tokenizer
        self.chat_ok = tokenizer is None or _has_chat_template(tokenizer)
        self.mapped = ((text_field, "text", "--text-field") if text_field is not None else
                       (messages_field, "messages", "--messages-field") if messages_field is not None else None)
        self.dropped: dict[str, int] = {}
        self.tool_call_turns = 0

    @property
    def sample_fields(self) -> tuple[str, ...]:
        """Record keys that can hold a sample (for the null check of dataset rows)."""
        return (self.mapped[0],) if self.mapped else ("messages", "turns", "prompt", "text")

    def _need_chat(self, lineno: int, fmt: str) -> None:
        if not self.chat_ok:
            name = getattr(self.tok, "name_or_path", "") or type(self.tok).__name__
            raise _err(self.path, lineno, f"a {fmt!r} sample needs a chat template, but the tokenizer "
                                          f"({name}) has none; use a chat/instruct model, or convert the "
                                          'corpus to {"text": ...} lines')

    def _str(self, lineno: int, rec: dict, key: str) -> str:
        v = rec[key]
        if not isinstance(v, str):
            if self.mapped is not None and key == self.mapped[1]:  # the user's field, not kvcal's internal name
                field, _, option = self.mapped
                raise _err(self.path, lineno, f"{field!r} ({option} {field}) must hold a string, got {_type_name(v)}; "
                                              f"pass the name of the field that holds the {key}")
            raise _err(self.path, lineno, f'"{key}" must be a string, got {_type_name(v)}; '
                                          f'write it as {{"{key}": "..."}}')
        return v

    def _chat(self, lineno: int, messages: list[dict], agp: bool) -> str:
        if self.tok is None:  # validation only
            return ""
        try:
            return _render_chat(self.tok, messages, agp)
        except Exception as e:  # jinja errors, raise_exception() in templates, ...
            raise _err(self.path, lineno, f"the tokenizer's chat template rejected this conversation "
                                          f"({type(e).__name__}: {_one_line(e)}); fix the roles/order "
                                          "the template expects") from None

    def parse(self, lineno: int, rec) -> tuple[str, str, bool]:
        path = self.path
        if not isinstance(rec, dict):
            raise _err(path, lineno, f"expected a JSON object, got {_type_name(rec)}; write one object "
                                     f"per line, e.g. {_EXAMPLE}")
        if self.mapped is not None:
            key, target, option = self.mapped
            if key not in rec:
                keys = ", ".join(str(k) for k in list(rec)[:8]) or "none"
                raise _err(path, lineno, f"no {key!r} field ({option}; keys: {_one_line(keys, 80)}); pass the "
                                         f"name of the field that holds the {target}")
            rec = {target: rec[key]}
        present = [k for k in ("messages", "turns", "prompt", "text") if k in rec]
        if len(present) > 1:  # which one the service sees is ambiguous: refuse rather than drop one silently
            raise _err(path, lineno, f"the record has both {' and '.join(repr(k) for k in present[:2])}; "
                                     f"keep one sample field per line (use one of {ACCEPTED_FIELDS})")
        if "messages" in rec:
            return "messages", self._messages(lineno, rec["messages"]), False
        if "turns" in rec:
            return "turns", self._turns(lineno, rec["turns"]), False
        if "prompt" in rec:
            prompt = self._str(lineno, rec, "prompt")
            ckey = "completion" if "completion" in rec else "response" if "response" in rec else None
            if ckey is None:
                return "prompt", prompt, True
            completion = self._str(lineno, rec, ckey)
            if self.chat_ok:
                conv = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
                return "prompt_completion", self._chat(lineno, conv, False), False
            return "prompt_completion", prompt + completion, True
        if "text" in rec:
            return "text", self._str(lineno, rec, "text"), True
        keys = ", ".join(list(rec)[:8]) or "none"
        hint = ' ("completion"/"response" need a "prompt")' if ("completion" in rec or "response" in rec) else ""
        known = ("text", "prompt", "messages", "turns")
        for k in rec:
            if not isinstance(k, str):
                continue
            for sep, name in ((";", "semicolon"), ("\t", "tab"), ("|", "pipe")):
                if sep in k and any(part.strip().lower() in known for part in k.split(sep)):
                    raise _err(path, lineno, f"the column name {k!r} holds {name}s: a {name}-separated file read as "
                                             "comma-separated CSV (kvcal reads commas only); save it with commas "
                                             "(quoting text that holds commas), or as JSON lines (.jsonl)")
            if k.strip().lower() in known and k not in known:  # "Text", " text": names are exact
                flag = "--messages-field" if k.strip().lower() in ("messages", "turns") else "--text-field"
                raise _err(path, lineno, f"no known field (keys: {_one_line(keys, 80)}): field names are exact, "
                                         f"{k!r} is not {k.strip().lower()!r}; pass {flag} {shlex.quote(k)} or "
                                         "rename it")
        raise _err(path, lineno, f"no known field (keys: {_one_line(keys, 80)}){hint}; "
                                 f"use one of {ACCEPTED_FIELDS}")

    def _messages(self, lineno: int, messages) -> str:
        path = self.path
        if not isinstance(messages, list) or not messages:
            got = "an empty list" if isinstance(messages, list) else _type_name(messages)
            raise _err(path, lineno, f'"messages" must be a non-empty list of {{"role", "content"}} objects, '
                                     f'got {got}; write [{{"role": "user", "content": "..."}}, ...]')
        conv = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise _err(path, lineno, f"messages[{i}] must be an object, got {_type_name(m)}; write it as "
                                         '{"role": "user", "content": "..."}')
            if "role" not in m:
                raise _err(path, lineno, f'messages[{i}] has no "role"; every message needs "role" and "content"')
            if not isinstance(m["role"], str):
                raise _err(path, lineno, f"messages[{i}].role must be a string, got {_type_name(m['role'])}; "
                                         'use "system", "user", "assistant" or "tool"')
            if m["role"] not in CHAT_ROLES:
                raise _err(path, lineno, f"messages[{i}].role {_one_line(m['role'], 40)!r} is not a chat role; "
                                         f"use one of {', '.join(CHAT_ROLES)}")
            calls = m.get("tool_calls")
            if calls is not None and not isinstance(calls, list):
                raise _err(path, lineno, f"messages[{i}].tool_calls must be a list, got {_type_name(calls)}; write "
                                         '[{"type": "function", "function": {"name": ..., "arguments": ...}}]')
            content = m.get("content")
            if content is None:
                if not (m["role"] == "assistant" and calls):
                    what = ' has no "content"' if "content" not in m else ".content is null"
                    raise _err(path, lineno, f"messages[{i}]{what}"
                                             '; every message needs "role" and "content" (null only for an '
                                             'assistant turn with "tool_calls")')
                content = ""
            elif isinstance(content, list):
                content = self._parts(lineno, i, content)
            elif not isinstance(content, str):
                raise _err(path, lineno, f"messages[{i}].content must be a string or a list of content parts, got "
                                         f'{_type_name(content)}; write "..." or [{{"type": "text", "text": "..."}}]')
            if calls:
                self.tool_call_turns += 1
            conv.append({**m, "content": content})
        self._need_chat(lineno, "messages")
        agp = conv[-1]["role"] != "assistant"
        return self._chat(lineno, conv, agp)

    def _parts(self, lineno, i: int, parts: list) -> str:
        """OpenAI content parts → the text parts joined with ``"\\n"`` (vLLM's join); every other
        part type is dropped and counted in ``self.dropped``."""
        texts = []
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                got = _type_name(part) if not isinstance(part, dict) else "an object without a string \"type\""
                raise _err(self.path, lineno, f"messages[{i}].content[{j}] must be a content part with a \"type\", "
                                              f'got {got}; write {{"type": "text", "text": "..."}}')
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise _err(self.path, lineno, f"messages[{i}].content[{j}].text must be a string, got "
                                                  f'{_type_name(part.get("text"))}; write {{"type": "text", "text": "..."}}')
                texts.append(part["text"])
            else:
                kind = _one_line(part["type"], 40)
                self.dropped[kind] = self.dropped.get(kind, 0) + 1
        return "\n".join(texts)

    def _turns(self, lineno: int, turns) -> str:
        path = self.path
        if not isinstance(turns, list) or not turns:
            got = "an empty list" if isinstance(turns, list) else _type_name(turns)
            raise _err(path, lineno, f'"turns" must be a non-empty list of user-turn strings, got {got}; '
                                     'use "messages" for role-tagged conversations')
        for i, t in enumerate(turns):
            if not isinstance(t, str):
                raise _err(path, lineno, f"turns[{i}] must be a string, got {_type_name(t)}; "
                                         '"turns" holds user turns only (use "messages" for roles)')
        self._need_chat(lineno, "turns")
        conv: list[dict] = []
        for i, t in enumerate(turns):
            if i:
                conv.append({"role": "assistant", "content": ""})
            conv.append({"role": "user", "content": t})
        return self._chat(lineno, conv, True)
