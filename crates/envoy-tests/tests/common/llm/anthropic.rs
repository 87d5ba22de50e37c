//! Anthropic's answers: messages, as JSON and as an event stream.

use super::body::{delta_literal, full_text, Gen};
use super::Spec;
use std::io::{self, Write};

const MSG_ID: &str = "msg_01XFDUDYJgAACzvnptvVoYEL";

impl Gen<'_> {
    // --- Anthropic messages

    fn messages_usage(s: &Spec, out: &mut dyn Write, output_tokens: u64) -> io::Result<()> {
        let i = s.input_tokens;
        write!(
            out,
            r#"{{"input_tokens":{i},"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":{output_tokens},"service_tier":"standard"}}"#
        )
    }

    pub(super) fn messages_json(&mut self) -> io::Result<()> {
        let (s, m) = (self.s, &self.model);
        write!(
            self.out,
            r#"{{"id":"{MSG_ID}","type":"message","role":"assistant","model":{m},"content":[{{"type":"text","text":""#
        )?;
        full_text(s, self.out)?;
        self.out
            .write_all(br#""}],"stop_reason":"end_turn","stop_sequence":null"#)?;
        if s.usage {
            self.out.write_all(br#","usage":"#)?;
            Gen::messages_usage(s, self.out, s.output_tokens)?;
        }
        self.out.write_all(b"}")?;
        self.out.flush()
    }

    pub(super) fn messages_stream(&mut self) -> io::Result<()> {
        let s = self.s;
        let m = self.model.clone();
        self.event(Some("message_start"), &|out| {
            write!(
                out,
                r#"{{"type":"message_start","message":{{"id":"{MSG_ID}","type":"message","role":"assistant","model":{m},"content":[],"stop_reason":null,"stop_sequence":null"#
            )?;
            if s.usage {
                out.write_all(br#","usage":"#)?;
                Gen::messages_usage(s, out, 1)?;
            }
            out.write_all(b"}}")
        })?;
        self.event(Some("content_block_start"), &|out| {
            out.write_all(
                br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            )
        })?;
        // The real API writes this one with a space.
        self.event(Some("ping"), &|out| out.write_all(br#"{"type": "ping"}"#))?;
        for i in 0..s.events {
            self.event(Some("content_block_delta"), &|out| {
                out.write_all(
                    br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":""#,
                )?;
                out.write_all(delta_literal(s, i).as_bytes())?;
                out.write_all(br#""}}"#)
            })?;
        }
        self.event(Some("content_block_stop"), &|out| {
            out.write_all(br#"{"type":"content_block_stop","index":0}"#)
        })?;
        self.event(Some("message_delta"), &|out| {
            out.write_all(
                br#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null}"#,
            )?;
            if s.usage {
                let o = s.output_tokens;
                write!(out, r#","usage":{{"output_tokens":{o}}}"#)?;
            }
            out.write_all(b"}")
        })?;
        self.event(Some("message_stop"), &|out| {
            out.write_all(br#"{"type":"message_stop"}"#)
        })?;
        self.end()
    }
}
