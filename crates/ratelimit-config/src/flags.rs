//! Command-line arguments as the CLI's commands read them: `--flag value`, `--flag=value`, and
//! words.

/// The arguments of one command, read in order.
pub struct Flags<'a> {
    args: std::slice::Iter<'a, String>,
}

impl<'a> Flags<'a> {
    /// Reads `args` (the command's, without its name).
    pub fn new(args: &'a [String]) -> Flags<'a> {
        Flags { args: args.iter() }
    }

    /// The next argument: a flag or a word, and the value written into it (`--flag=value`).
    pub fn next_arg(&mut self) -> Option<(&'a str, Option<&'a str>)> {
        let arg = self.args.next()?;
        Some(match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag, Some(value)),
            _ => (arg.as_str(), None),
        })
    }

    /// The value of `flag`: the one written into it, else the next argument.
    pub fn value(&mut self, flag: &str, inline: Option<&str>) -> Result<String, String> {
        inline
            .map(str::to_string)
            .or_else(|| self.args.next().cloned())
            .ok_or_else(|| format!("{flag} needs a value"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn flags_take_their_value_either_way() {
        let args: Vec<String> = ["--a", "1", "--b=2", "word", "--c"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut f = Flags::new(&args);
        let (flag, inline) = f.next_arg().unwrap();
        assert_eq!((flag, f.value(flag, inline).unwrap()), ("--a", "1".into()));
        let (flag, inline) = f.next_arg().unwrap();
        assert_eq!((flag, f.value(flag, inline).unwrap()), ("--b", "2".into()));
        assert_eq!(f.next_arg(), Some(("word", None)));
        let (flag, inline) = f.next_arg().unwrap();
        assert_eq!(f.value(flag, inline), Err("--c needs a value".into()));
        assert_eq!(f.next_arg(), None);
    }
}
