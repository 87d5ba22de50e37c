//! OpenAI's answers: chat completions and Responses, as JSON and as event streams.

use super::body::{delta_literal, full_text, Data, Gen};
use super::Spec;
use std::io::{self, Write};

const CREATED: u64 = 1_741_569_952;
const CHAT_ID: &str = "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT";
const FINGERPRINT: &str = "fp_06737a9306";
const RESP_ID: &str = "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b";
const ITEM_ID: &str = "msg_67ccd2bf17f0819081ff3bb2cf6508e60bb6a6b452d3795b";

impl Gen<'_> {
    // --- OpenAI chat completions

    fn chat_usage(s: &Spec, out: &mut dyn Write) -> io::Result<()> {
        let (i, o) = (s.input_tokens, s.output_tokens);
        let t = i + o;
        write!(
            out,
            r#"{{"prompt_tokens":{i},"completion_tokens":{o},"total_tokens":{t},"prompt_tokens_details":{{"cached_tokens":0,"audio_tokens":0}},"completion_tokens_details":{{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}}"#
        )
    }

    pub(super) fn chat_json(&mut self) -> io::Result<()> {
        let (s, m) = (self.s, &self.model);
        write!(
            self.out,
            r#"{{"id":"{CHAT_ID}","object":"chat.completion","created":{CREATED},"model":{m},"choices":[{{"index":0,"message":{{"role":"assistant","content":""#
        )?;
        full_text(s, self.out)?;
        write!(
            self.out,
            r#"","refusal":null,"annotations":[]}},"logprobs":null,"finish_reason":"stop"}}]"#
        )?;
        if s.usage {
            self.out.write_all(br#","usage":"#)?;
            Gen::chat_usage(s, self.out)?;
        }
        write!(
            self.out,
            r#","service_tier":"default","system_fingerprint":"{FINGERPRINT}"}}"#
        )?;
        self.out.flush()
    }

    pub(super) fn chat_stream(&mut self) -> io::Result<()> {
        let s = self.s;
        let m = self.model.clone();
        let with_usage = s.usage && s.include_usage;
        // One chunk: `choice` is the element of `choices` (None: empty, the usage chunk).
        let chunk = |out: &mut dyn Write, choice: Data, usage: bool| -> io::Result<()> {
            write!(
                out,
                r#"{{"id":"{CHAT_ID}","object":"chat.completion.chunk","created":{CREATED},"model":{m},"service_tier":"default","system_fingerprint":"{FINGERPRINT}","choices":["#
            )?;
            choice(out)?;
            out.write_all(b"]")?;
            if usage {
                out.write_all(br#","usage":"#)?;
                Gen::chat_usage(s, out)?;
            } else if with_usage {
                out.write_all(br#","usage":null"#)?;
            }
            out.write_all(b"}")
        };
        self.event(None, &|out| {
            chunk(
                out,
                &|out| {
                    out.write_all(
                        br#"{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}"#,
                    )
                },
                false,
            )
        })?;
        for i in 0..s.events {
            self.event(None, &|out| {
                chunk(
                    out,
                    &|out| {
                        out.write_all(br#"{"index":0,"delta":{"content":""#)?;
                        out.write_all(delta_literal(s, i).as_bytes())?;
                        out.write_all(br#""},"logprobs":null,"finish_reason":null}"#)
                    },
                    false,
                )
            })?;
        }
        self.event(None, &|out| {
            chunk(
                out,
                &|out| {
                    out.write_all(
                        br#"{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}"#,
                    )
                },
                false,
            )
        })?;
        if with_usage {
            self.event(None, &|out| chunk(out, &|_| Ok(()), true))?;
        }
        self.done()?;
        self.end()
    }

    // --- OpenAI Responses

    fn responses_usage(s: &Spec, out: &mut dyn Write) -> io::Result<()> {
        let (i, o) = (s.input_tokens, s.output_tokens);
        let t = i + o;
        write!(
            out,
            r#"{{"input_tokens":{i},"input_tokens_details":{{"cached_tokens":0}},"output_tokens":{o},"output_tokens_details":{{"reasoning_tokens":0}},"total_tokens":{t}}}"#
        )
    }

    /// The message item; its text is the whole text when `completed`.
    fn responses_item(s: &Spec, out: &mut dyn Write, completed: bool) -> io::Result<()> {
        if completed {
            write!(
                out,
                r#"{{"id":"{ITEM_ID}","type":"message","status":"completed","content":[{{"type":"output_text","annotations":[],"logprobs":[],"text":""#
            )?;
            full_text(s, out)?;
            out.write_all(br#""}],"role":"assistant"}"#)
        } else {
            write!(
                out,
                r#"{{"id":"{ITEM_ID}","type":"message","status":"in_progress","content":[],"role":"assistant"}}"#
            )
        }
    }

    /// The response object; with its output and usage when `completed`.
    fn responses_object(
        s: &Spec,
        model: &str,
        out: &mut dyn Write,
        completed: bool,
    ) -> io::Result<()> {
        let status = if completed {
            "completed"
        } else {
            "in_progress"
        };
        write!(
            out,
            r#"{{"id":"{RESP_ID}","object":"response","created_at":{CREATED},"status":"{status}","background":false,"error":null,"incomplete_details":null,"instructions":null,"max_output_tokens":null,"model":{model},"output":["#
        )?;
        if completed {
            Gen::responses_item(s, out, true)?;
        }
        out.write_all(
            br#"],"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{"effort":null,"summary":null},"store":true,"temperature":1.0,"text":{"format":{"type":"text"},"verbosity":"medium"},"tool_choice":"auto","tools":[],"top_p":1.0,"truncation":"disabled""#,
        )?;
        if s.usage {
            out.write_all(br#","usage":"#)?;
            if completed {
                Gen::responses_usage(s, out)?;
            } else {
                out.write_all(b"null")?;
            }
        }
        out.write_all(br#","user":null,"metadata":{}}"#)
    }

    pub(super) fn responses_json(&mut self) -> io::Result<()> {
        Gen::responses_object(self.s, &self.model, self.out, true)?;
        self.out.flush()
    }

    pub(super) fn responses_stream(&mut self) -> io::Result<()> {
        let (s, model) = (self.s, self.model.clone());
        let m = model.as_str();
        let part = format!(r#""item_id":"{ITEM_ID}","output_index":0,"content_index":0,"#);
        let text_part = r#""part":{"type":"output_text","annotations":[],"logprobs":[],"text":""#;
        let mut seq = 0;
        let object =
            |completed| move |out: &mut dyn Write| Gen::responses_object(s, m, out, completed);
        let item = |completed| move |out: &mut dyn Write| Gen::responses_item(s, out, completed);
        let nothing = |_: &mut dyn Write| Ok(());
        for name in ["response.created", "response.in_progress"] {
            self.responses_event(&mut seq, name, r#""response":"#, &object(false), b"}")?;
        }
        let at_item = r#""output_index":0,"item":"#;
        self.responses_event(
            &mut seq,
            "response.output_item.added",
            at_item,
            &item(false),
            b"}",
        )?;
        let added = format!(r#"{part}{text_part}"}}"#);
        self.responses_event(
            &mut seq,
            "response.content_part.added",
            &added,
            &nothing,
            b"}",
        )?;
        for i in 0..s.events {
            let delta = |out: &mut dyn Write| out.write_all(delta_literal(s, i).as_bytes());
            let head = format!(r#"{part}"delta":""#);
            let name = "response.output_text.delta";
            self.responses_event(&mut seq, name, &head, &delta, br#"","logprobs":[]}"#)?;
        }
        let whole = |out: &mut dyn Write| full_text(s, out);
        let head = format!(r#"{part}"text":""#);
        let name = "response.output_text.done";
        self.responses_event(&mut seq, name, &head, &whole, br#"","logprobs":[]}"#)?;
        let head = format!("{part}{text_part}");
        let name = "response.content_part.done";
        self.responses_event(&mut seq, name, &head, &whole, br#""}}"#)?;
        self.responses_event(
            &mut seq,
            "response.output_item.done",
            at_item,
            &item(true),
            b"}",
        )?;
        self.responses_event(
            &mut seq,
            "response.completed",
            r#""response":"#,
            &object(true),
            b"}",
        )?;
        self.end()
    }

    /// One event of a Responses stream, numbered `seq` (then counted): its type and number,
    /// then `fields` as written, what `inner` writes, and `tail`.
    fn responses_event(
        &mut self,
        seq: &mut u64,
        name: &str,
        fields: &str,
        inner: Data,
        tail: &[u8],
    ) -> io::Result<()> {
        let n = *seq;
        *seq += 1;
        self.event(Some(name), &|out| {
            write!(out, r#"{{"type":"{name}","sequence_number":{n},{fields}"#)?;
            inner(out)?;
            out.write_all(tail)
        })
    }
}
