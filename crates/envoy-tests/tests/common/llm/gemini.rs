//! Gemini's answers: generateContent (pretty-printed JSON) and streamGenerateContent.

use super::body::{delta_literal, full_text, Gen};
use std::io;

const GEMINI_ID: &str = "mKZ0aOq9D4-ejMcP7sTfmQk";

impl Gen<'_> {
    // --- Gemini

    /// Pretty-printed, as the real API answers.
    pub(super) fn gemini_json(&mut self) -> io::Result<()> {
        let (s, m) = (self.s, &self.model);
        self.out.write_all(
            b"{\n  \"candidates\": [\n    {\n      \"content\": {\n        \"parts\": [\n          {\n            \"text\": \"",
        )?;
        full_text(s, self.out)?;
        self.out.write_all(
            b"\"\n          }\n        ],\n        \"role\": \"model\"\n      },\n      \"finishReason\": \"STOP\",\n      \"avgLogprobs\": -0.12345678901234\n    }\n  ],\n",
        )?;
        if s.usage {
            let (i, o) = (s.input_tokens, s.output_tokens);
            let t = i + o;
            write!(
                self.out,
                "  \"usageMetadata\": {{\n    \"promptTokenCount\": {i},\n    \"candidatesTokenCount\": {o},\n    \"totalTokenCount\": {t},\n    \"promptTokensDetails\": [\n      {{\n        \"modality\": \"TEXT\",\n        \"tokenCount\": {i}\n      }}\n    ],\n    \"candidatesTokensDetails\": [\n      {{\n        \"modality\": \"TEXT\",\n        \"tokenCount\": {o}\n      }}\n    ]\n  }},\n"
            )?;
        }
        write!(
            self.out,
            "  \"modelVersion\": {m},\n  \"responseId\": \"{GEMINI_ID}\"\n}}\n"
        )?;
        self.out.flush()
    }

    pub(super) fn gemini_stream(&mut self) -> io::Result<()> {
        let s = self.s;
        let m = self.model.clone();
        // With no content event, one empty one still says how it ended, and the usage.
        let n = s.events.max(1);
        for i in 0..n {
            let last = i + 1 == n;
            self.event(None, &|out| {
                out.write_all(br#"{"candidates":[{"content":{"parts":[{"text":""#)?;
                if i < s.events {
                    out.write_all(delta_literal(s, i).as_bytes())?;
                }
                out.write_all(br#""}],"role":"model"}"#)?;
                if last {
                    out.write_all(br#","finishReason":"STOP""#)?;
                }
                out.write_all(br#","index":0}]"#)?;
                if s.usage {
                    let p = s.input_tokens;
                    // Cumulative: the output so far.
                    let c = s.output_tokens * (i as u64 + 1) / n as u64;
                    let t = p + c;
                    write!(
                        out,
                        r#","usageMetadata":{{"promptTokenCount":{p},"candidatesTokenCount":{c},"totalTokenCount":{t},"promptTokensDetails":[{{"modality":"TEXT","tokenCount":{p}}}]}}"#
                    )?;
                }
                write!(out, r#","modelVersion":{m},"responseId":"{GEMINI_ID}"}}"#)
            })?;
        }
        self.end()
    }
}
