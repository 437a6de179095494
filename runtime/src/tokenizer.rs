//! Tokenizer, chat template and streaming text: loads `tokenizer.json` (the `tokenizers` crate) and
//! `tokenizer_config.json` (chat template, special tokens), renders chat templates with minijinja (with the
//! Python-compatible string and dict methods of `minijinja-contrib`), turns reply tokens into text incrementally for
//! streaming, and finds stop strings (`rounds.md` section 1 step 3).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Errors loading a tokenizer or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause (in the message, not a separate source, so that it prints once).
        cause: std::io::Error,
    },
    /// `tokenizer.json` could not be parsed.
    #[error("{path}: {message}")]
    Load {
        /// The file.
        path: PathBuf,
        /// What the tokenizers crate said.
        message: String,
    },
    /// `tokenizer_config.json` is not valid JSON.
    #[error("{path}: {cause}")]
    Config {
        /// The file.
        path: PathBuf,
        /// The cause (in the message, as `Io`'s).
        cause: serde_json::Error,
    },
    /// A field of `tokenizer_config.json` (or the file itself) has the wrong type.
    #[error("{path}: {field} is {found}, expected {expected}")]
    ConfigField {
        /// The file.
        path: PathBuf,
        /// The field (`the file` for the top level).
        field: &'static str,
        /// What the file holds there (its JSON type).
        found: &'static str,
        /// What is read there.
        expected: &'static str,
    },
    /// Encoding or decoding failed.
    #[error("tokenizer: {0}")]
    Codec(String),
    /// The model has no chat template.
    #[error(
        "the model has no chat template (tokenizer_config.json has no chat_template, and there is no \
         chat_template.jinja beside it)"
    )]
    NoChatTemplate,
    /// The chat template does not parse. Found when the tokenizer loads ([`Tokenizer::chat_template_error`], which
    /// the commands print as a warning at start-up); the load goes on, so that completions are served, and every use
    /// of the template returns this error.
    #[error("{origin}: the chat template does not parse: {message}")]
    TemplateSyntax {
        /// Where the template comes from: `chat_template.jinja`'s path, or tokenizer_config.json's with its field.
        origin: String,
        /// minijinja's syntax error (with the template's line).
        message: String,
    },
    /// The chat template called `raise_exception`: it refuses these messages (a role order it does not take, say).
    #[error("the chat template refuses these messages: {0}")]
    TemplateRaised(String),
    /// The chat template failed to render for a reason of its own (not a `raise_exception`): a fault of the
    /// template, not of the messages.
    #[error("chat template: {0}")]
    Template(String),
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

/// Bytes of text a piece of [`Tokenizer::exceeds`] holds, about.
pub const COUNT_PIECE: usize = 64 << 10;
/// Tokens a cut between two pieces may add in [`Tokenizer::exceeds`] (a word cut in two encodes to a few more).
pub const CUT_MARGIN: usize = 8;

/// The end of the piece of [`Tokenizer::exceeds`] that starts at `start`: the first place from `start +
/// COUNT_PIECE` on (within 4 KB) that follows a line break or precedes a space before a letter, else the next
/// character boundary; the text's end when less than a piece is left.
fn piece_end(text: &str, start: usize) -> usize {
    let target = start + COUNT_PIECE;
    if target >= text.len() {
        return text.len();
    }
    let b = text.as_bytes();
    let limit = (target + 4096).min(text.len() - 1);
    for i in target..limit {
        let after_break = b[i - 1] == b'\n' && !b[i].is_ascii_whitespace();
        let before_word =
            b[i] == b' ' && !b[i - 1].is_ascii_whitespace() && b[i + 1].is_ascii_alphabetic();
        if after_break || before_word {
            return i;
        }
    }
    (target..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len())
}

/// A special token in `tokenizer_config.json`: a plain string or an `AddedToken` object with `content`.
fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(m) => m.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// A chat template, parsed when the tokenizer loads.
struct ChatTemplate {
    /// The environment holding the parsed template (trimmed blocks, Python-compatible methods, `raise_exception`).
    env: minijinja::Environment<'static>,
    /// The template's name in `env`, which minijinja's errors give with a line: `chat_template.jinja` when it comes
    /// from that file, `chat_template` from tokenizer_config.json.
    name: &'static str,
}

/// The error `raise_exception` raises, as the source of minijinja's error: a render's error that carries it is
/// the template refusing its messages, any other a fault of the template.
#[derive(Debug, thiserror::Error)]
#[error("raised by the chat template")]
struct Raised;

/// The environment a chat template renders in, as transformers': trimmed blocks, Python-compatible methods, and
/// `raise_exception`.
fn template_env() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    minijinja_contrib::add_to_environment(&mut env);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(
                minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg)
                    .with_source(Raised),
            )
        },
    );
    env
}

/// A template with transformers' `{% generation %}` ... `{% endgeneration %}` tags (its `AssistantTracker`
/// extension, which renders the body as it stands and only records where assistant text falls) written as
/// `{% if true %}` ... `{% endif %}`, which render the same text; each tag's whitespace control (`-`, `+`) is kept,
/// so the text around it is trimmed as before, and each newline inside a tag, so that minijinja's errors give the
/// template's own line numbers. minijinja knows no such tag. Where this differs from transformers: a `{% set %}`
/// inside the body is seen after it (jinja2 renders the body in a scope of its own), and tag text inside a string
/// or a `{% raw %}` block is rewritten too.
fn generation_tags_as_blocks(src: &str) -> std::borrow::Cow<'_, str> {
    if !src.contains("generation") {
        return std::borrow::Cow::Borrowed(src);
    }
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        match generation_tag(rest) {
            Some((len, left, end, right)) => {
                out.push_str("{%");
                out.extend(left);
                out.push_str(if end { " endif" } else { " if true" });
                out.extend(rest[..len].matches('\n'));
                out.push(' ');
                out.extend(right);
                out.push_str("%}");
                rest = &rest[len..];
            }
            None => {
                out.push_str("{%");
                rest = &rest[2..];
            }
        }
    }
    out.push_str(rest);
    std::borrow::Cow::Owned(out)
}

/// The tag `s` starts with, when it is a `generation` or `endgeneration` tag: its length in bytes, its left
/// whitespace control, whether it is the end tag, and its right whitespace control.
fn generation_tag(s: &str) -> Option<(usize, Option<char>, bool, Option<char>)> {
    let inner = s.strip_prefix("{%")?;
    let close = inner.find("%}")?;
    let body = &inner[..close];
    let control = |c: Option<char>| c.filter(|c| matches!(c, '-' | '+'));
    let left = control(body.chars().next());
    let body = &body[left.map_or(0, char::len_utf8)..];
    let right = control(body.chars().last());
    let body = &body[..body.len() - right.map_or(0, char::len_utf8)];
    let end = match body.trim() {
        "generation" => false,
        "endgeneration" => true,
        _ => return None,
    };
    Some((2 + close + 2, left, end, right))
}

impl ChatTemplate {
    /// Parses `src`, named `name`, with transformers' `generation` tags read as plain blocks
    /// ([`generation_tags_as_blocks`]).
    ///
    /// # Errors
    /// minijinja's syntax error, as text (with the template's name and line).
    fn parse(src: &str, name: &'static str) -> Result<Self, String> {
        let mut env = template_env();
        let text = generation_tags_as_blocks(src);
        let rewritten = matches!(text, std::borrow::Cow::Owned(_));
        env.add_template_owned(name, text.into_owned())
            .map_err(|e| {
                let note = if rewritten {
                    " (its `{% generation %}` and `{% endgeneration %}` tags are read as `{% if true %}` and \
                     `{% endif %}`)"
                } else {
                    ""
                };
                format!("{e}{note}")
            })?;
        Ok(ChatTemplate { env, name })
    }

    /// Renders the template with `ctx`.
    ///
    /// # Errors
    /// [`TokenizerError::TemplateRaised`] when the template called `raise_exception`, else
    /// [`TokenizerError::Template`].
    fn render(&self, ctx: minijinja::Value) -> Result<String, TokenizerError> {
        let failed = |e: minijinja::Error| {
            let mut cause = std::error::Error::source(&e);
            while let Some(c) = cause {
                if c.is::<Raised>() {
                    return TokenizerError::TemplateRaised(
                        e.detail().unwrap_or_default().to_string(),
                    );
                }
                cause = c.source();
            }
            TokenizerError::Template(e.to_string())
        };
        // minijinja 2.24 panics on some templates that jinja2 renders (a `{% break %}` inside a `{% with %}`
        // block inside a loop): a fault of the template, reported as one.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.env.get_template(self.name).and_then(|t| t.render(ctx))
        }))
        .map_err(|_| {
            TokenizerError::Template(format!(
                "the template engine (minijinja) failed on the {} template for these messages",
                self.name
            ))
        })?
        .map_err(failed)
    }
}

/// The error of a chat template kept as (where it comes from, minijinja's syntax error) because it does not parse.
fn syntax_error((origin, message): &(String, String)) -> TokenizerError {
    TokenizerError::TemplateSyntax {
        origin: origin.clone(),
        message: message.clone(),
    }
}

/// A model's tokenizer with its chat template and special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The chat template in force: parsed, or where it comes from and why it does not parse.
    chat_template: Option<Result<ChatTemplate, (String, String)>>,
    /// The eos token string, if declared.
    pub eos_token: Option<String>,
    /// The bos token string, if declared.
    pub bos_token: Option<String>,
    /// The pad token string, if declared.
    pub pad_token: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.vocab_size())
            .field("eos_token", &self.eos_token)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `DIR/tokenizer.json` and, when present, `DIR/tokenizer_config.json` and `DIR/chat_template.jinja`.
    /// The chat template in force is parsed here; one that does not parse is kept as its error
    /// ([`Tokenizer::chat_template_error`]), and the load goes on.
    ///
    /// # Errors
    /// [`TokenizerError`] naming the file: an unreadable or malformed tokenizer.json or tokenizer_config.json.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let cfg = dir.join("tokenizer_config.json");
        // Recent transformers save the template beside the config, as chat_template.jinja, which then comes before
        // the config's `chat_template` (as transformers loads them).
        let jinja = dir.join("chat_template.jinja");
        Self::load(
            &dir.join("tokenizer.json"),
            cfg.exists().then_some(cfg.as_path()),
            jinja.exists().then_some(jinja.as_path()),
        )
    }

    /// Loads a `tokenizer.json` and an optional `tokenizer_config.json`, parsing the config's chat template.
    ///
    /// # Errors
    /// [`TokenizerError`] naming the file: an unreadable or malformed tokenizer.json or tokenizer_config.json.
    pub fn from_files(tokenizer: &Path, config: Option<&Path>) -> Result<Self, TokenizerError> {
        Self::load(tokenizer, config, None)
    }

    /// [`Tokenizer::from_files`], with the chat template of `jinja` (a `chat_template.jinja`) instead of the config's
    /// when given. Only the template in force is parsed.
    fn load(
        tokenizer: &Path,
        config: Option<&Path>,
        jinja: Option<&Path>,
    ) -> Result<Self, TokenizerError> {
        let bytes = std::fs::read(tokenizer).map_err(|cause| TokenizerError::Io {
            path: tokenizer.to_path_buf(),
            cause,
        })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::Load {
                path: tokenizer.to_path_buf(),
                message: e.to_string(),
            })?;
        let mut t = Tokenizer {
            inner,
            chat_template: None,
            eos_token: None,
            bos_token: None,
            pad_token: None,
        };
        // The template's text, its name and where it comes from (for a syntax error).
        let mut template: Option<(String, &'static str, String)> = None;
        if let Some(cp) = config {
            let text = std::fs::read_to_string(cp).map_err(|cause| TokenizerError::Io {
                path: cp.to_path_buf(),
                cause,
            })?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|cause| TokenizerError::Config {
                    path: cp.to_path_buf(),
                    cause,
                })?;
            let field = |field, found, expected| TokenizerError::ConfigField {
                path: cp.to_path_buf(),
                field,
                found,
                expected,
            };
            if !v.is_object() {
                return Err(field(
                    "the file",
                    crate::server::api::type_name(&v),
                    "a JSON object",
                ));
            }
            let templates = "a string, or a list of {\"name\", \"template\"} objects";
            let text = match v.get("chat_template") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                // A list of named templates: take "default", else the first.
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|e| e.get("template"))
                    .and_then(|s| s.as_str())
                    .map(str::to_string)
                    .map(Some)
                    .ok_or_else(|| {
                        field(
                            "chat_template",
                            "a list without a template string",
                            templates,
                        )
                    })?,
                Some(other) => {
                    return Err(field(
                        "chat_template",
                        crate::server::api::type_name(other),
                        templates,
                    ))
                }
            };
            template = text.map(|text| {
                let origin = format!("{} (its chat_template field)", cp.display());
                (text, "chat_template", origin)
            });
            t.eos_token = token_string(v.get("eos_token"));
            t.bos_token = token_string(v.get("bos_token"));
            t.pad_token = token_string(v.get("pad_token"));
        }
        if let Some(jp) = jinja {
            let text = std::fs::read_to_string(jp).map_err(|cause| TokenizerError::Io {
                path: jp.to_path_buf(),
                cause,
            })?;
            template = Some((text, "chat_template.jinja", jp.display().to_string()));
        }
        t.chat_template = template
            .map(|(text, name, origin)| ChatTemplate::parse(&text, name).map_err(|m| (origin, m)));
        Ok(t)
    }

    /// The vocabulary size including added tokens.
    pub fn vocab_size(&self) -> u32 {
        self.inner.get_vocab_size(true) as u32
    }

    /// The largest token id the tokenizer can produce (its vocabulary's and its added tokens'), `None` for an
    /// empty vocabulary.
    pub fn max_token_id(&self) -> Option<u32> {
        self.inner.get_vocab(true).into_values().max()
    }

    /// The id of a token string (a special token such as `<|im_end|>`), if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// True when the tokenizer config has a chat template (one that parses or not).
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Why the chat template in force cannot be used: [`TokenizerError::TemplateSyntax`] naming its file and
    /// minijinja's syntax error; `None` when it parses or there is none.
    pub fn chat_template_error(&self) -> Option<TokenizerError> {
        match &self.chat_template {
            Some(Err(unparsed)) => Some(syntax_error(unparsed)),
            _ => None,
        }
    }

    /// Encodes text. Special tokens written in the text (`<|im_start|>`) become their ids; `add_special_tokens`
    /// applies the post-processor (bos and the like, if the tokenizer has one).
    ///
    /// # Errors
    /// [`TokenizerError::Codec`].
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// Whether `text` certainly encodes to more than `limit` tokens, found without encoding it whole: it is encoded
    /// in pieces of about [`COUNT_PIECE`] bytes, each ending where a pre-tokenizer splits (before a space that
    /// starts a word, or after a line break), or, in a run with no such place, at a character boundary, and the
    /// answer is yes once the pieces' tokens pass `limit` plus [`CUT_MARGIN`] a cut (a cut inside a word can add a
    /// few tokens). Encoding a text of tens of megabytes whole takes gigabytes (about 190 bytes a byte of input with
    /// the Qwen vocabulary); this reads a few pieces past `limit`'s worth. `false` for a text of one piece or less
    /// (encode it whole).
    ///
    /// # Errors
    /// [`TokenizerError::Codec`] from a piece.
    pub fn exceeds(&self, text: &str, limit: usize) -> Result<bool, TokenizerError> {
        if text.len() <= COUNT_PIECE {
            return Ok(false);
        }
        let (mut start, mut count, mut cuts) = (0usize, 0usize, 0usize);
        while start < text.len() {
            let end = piece_end(text, start);
            count += self.encode(&text[start..end], false)?.len();
            cuts += usize::from(end < text.len());
            if count > limit + CUT_MARGIN * cuts {
                return Ok(true);
            }
            start = end;
        }
        Ok(false)
    }

    /// Decodes ids to text (lossy for incomplete UTF-8); `skip_special` leaves out special tokens.
    ///
    /// # Errors
    /// [`TokenizerError::Codec`] (an id outside the vocabulary, for instance).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    /// Renders the chat template for `messages` (with `add_generation_prompt`), as transformers'
    /// `apply_chat_template(..., tokenize=False)` does: the variables `messages`, `add_generation_prompt`,
    /// `bos_token`, `eos_token`, `pad_token`, and `raise_exception`.
    ///
    /// # Errors
    /// [`TokenizerError::NoChatTemplate`], [`TokenizerError::TemplateSyntax`] (it does not parse:
    /// [`Tokenizer::chat_template_error`]), [`TokenizerError::TemplateRaised`] (the template's `raise_exception`: it
    /// refuses these messages) or [`TokenizerError::Template`] (any other failure: a fault of the template).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = match &self.chat_template {
            None => return Err(TokenizerError::NoChatTemplate),
            Some(Ok(t)) => t,
            Some(Err(unparsed)) => return Err(syntax_error(unparsed)),
        };
        template.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
            pad_token => self.pad_token.clone().unwrap_or_default(),
        })
    }
}

/// Incremental detokenization: turns reply tokens into text pieces, emitting each character as soon as it is
/// complete UTF-8: a token that ends inside a multi-byte character emits the text before that character, and the
/// character waits for the token that completes it (so a stop string ends at the token that completes its text,
/// even when that token also starts a character). Decodes a short window of earlier tokens and the window plus the
/// new ones, and emits the difference, so that tokenizers which change spacing at word starts stream the same text
/// as a one-piece decode.
#[derive(Debug, Clone, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Bytes of the window's new text (the decode past the prefix) already emitted while its end was incomplete.
    emitted: usize,
}

impl Detokenizer {
    /// A detokenizer for a reply (no prompt context).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a token; returns the new text it completes (possibly empty).
    ///
    /// # Errors
    /// [`TokenizerError::Codec`].
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], true)?;
        let same_shape = full.starts_with(&prefix);
        let start = if same_shape {
            prefix.len() + self.emitted
        } else {
            // The window's text changed shape (rare): what follows the common prefix, less what was emitted.
            let common = full
                .char_indices()
                .zip(prefix.chars())
                .take_while(|((_, a), b)| a == b)
                .last()
                .map(|((i, c), _)| i + c.len_utf8())
                .unwrap_or(0);
            let past = prefix.len() + self.emitted;
            if self.emitted > 0 && past <= full.len() && full.is_char_boundary(past) {
                common.max(past)
            } else {
                common
            }
        };
        if full.ends_with('\u{FFFD}') {
            // Emit the complete characters before the incomplete one at the end; keep the window open for it.
            let stable = full.trim_end_matches('\u{FFFD}').len();
            if !same_shape || stable <= start {
                return Ok(String::new());
            }
            self.emitted = stable - prefix.len();
            return Ok(full[start..stable].to_string());
        }
        if same_shape && full.len() <= start {
            return Ok(String::new());
        }
        let new = full.get(start..).unwrap_or_default().to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.emitted = 0;
        Ok(new)
    }

    /// The text not yet emitted (an incomplete character at the end decodes lossily); call at the end of a reply.
    ///
    /// # Errors
    /// [`TokenizerError::Codec`].
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], true)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], true)?;
        let start = prefix.len() + self.emitted;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        self.emitted = 0;
        Ok(full.get(start..).unwrap_or_default().to_string())
    }

    /// The tokens pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

/// What one token did to a reply's text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextDelta {
    /// Text safe to send now (never part of a stop string).
    pub text: String,
    /// A stop string was completed by this token: the reply ends here.
    pub stopped: bool,
}

/// A reply's text as it streams: detokenizes tokens and finds stop strings. Text that could be the start of a
/// stop string is held back until it is known not to be one; when a stop string completes, the text ends just
/// before it (`rounds.md` section 1 step 3).
#[derive(Debug, Clone, Default)]
pub struct TextStream {
    detok: Detokenizer,
    stops: Vec<String>,
    text: String,
    sent: usize,
    stopped: bool,
}

impl TextStream {
    /// A stream with the given stop strings (empty ones are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        TextStream {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Default::default()
        }
    }

    /// Adds a reply token.
    ///
    /// # Errors
    /// [`TokenizerError::Codec`].
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<TextDelta, TokenizerError> {
        if self.stopped {
            return Ok(TextDelta {
                text: String::new(),
                stopped: true,
            });
        }
        let piece = self.detok.push(tok, id)?;
        self.text.push_str(&piece);
        Ok(self.advance(false))
    }

    /// Ends the reply: returns the text still held back (nothing after a stop string).
    ///
    /// # Errors
    /// [`TokenizerError::Codec`].
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        if self.stopped {
            return Ok(String::new());
        }
        let piece = self.detok.flush(tok)?;
        self.text.push_str(&piece);
        Ok(self.advance(true).text)
    }

    /// Adds a reply's last token when it is one of the request's `stop_token_ids`: counted in [`TextStream::ids`]
    /// (so in `usage` and `token_sha`) but left out of the text, as a stop string is; returns the text still held
    /// back, and the stream is stopped. After a stop string it does nothing, as [`TextStream::push`].
    ///
    /// # Errors
    /// [`TokenizerError::Codec`].
    pub fn push_stop_token(
        &mut self,
        tok: &Tokenizer,
        id: u32,
    ) -> Result<TextDelta, TokenizerError> {
        // Counted unless a stop string already ended the reply; one that the held-back text completes now ends it
        // at this token, which therefore counts.
        let stopped_before = self.stopped;
        let text = self.finish(tok)?;
        if !stopped_before {
            self.detok.ids.push(id);
            self.stopped = true;
        }
        Ok(TextDelta {
            text,
            stopped: true,
        })
    }

    /// The reply's full text so far (what was sent plus what is held back; past a stop, up to the stop).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The tokens pushed so far (including the one that completed a stop string).
    pub fn ids(&self) -> &[u32] {
        self.detok.ids()
    }

    fn advance(&mut self, end: bool) -> TextDelta {
        // Search from where a stop string could start that ends in the new text.
        let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut from = self.sent.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| p + from))
            .min();
        if let Some(p) = hit {
            let p = p.max(self.sent);
            let text = self.text[self.sent..p].to_string();
            self.text.truncate(p);
            self.sent = p;
            self.stopped = true;
            return TextDelta {
                text,
                stopped: true,
            };
        }
        let mut upto = self.text.len();
        if !end {
            // Hold back the longest suffix that is a proper prefix of a stop string.
            for s in &self.stops {
                for (i, _) in s.char_indices().skip(1) {
                    if i > self.text.len() {
                        break;
                    }
                    if self.text.ends_with(&s[..i]) {
                        upto = upto.min(self.text.len() - i);
                    }
                }
            }
        }
        let upto = upto.max(self.sent);
        let text = self.text[self.sent..upto].to_string();
        self.sent = upto;
        TextDelta {
            text,
            stopped: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
    }

    fn tiny() -> Tokenizer {
        Tokenizer::from_dir(&root().join("models/flashnext-tiny")).expect("tokenizer")
    }

    #[test]
    fn qwen_tokenizer_matches_expected() {
        // Stored gzipped (15 MB of JSON) to keep the repository small.
        let dir = root().join("fixtures/qwen-tokenizer");
        let tmp = tempfile::tempdir().unwrap();
        let json = tmp.path().join("tokenizer.json");
        let gz = std::fs::File::open(dir.join("tokenizer.json.gz")).unwrap();
        std::io::copy(
            &mut flate2::read::GzDecoder::new(gz),
            &mut std::fs::File::create(&json).unwrap(),
        )
        .unwrap();
        let t = Tokenizer::from_files(&json, Some(&dir.join("tokenizer_config.json")))
            .expect("qwen tokenizer loads (ignore_merges)");
        let exp: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let samples = exp["samples"].as_array().unwrap();
        assert!(!samples.is_empty());
        for s in samples {
            let text = s["text"].as_str().unwrap();
            let want: Vec<u32> = s["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(t.encode(text, false).unwrap(), want, "text {text:?}");
        }
        for (name, id) in exp["special_tokens"].as_object().unwrap() {
            assert_eq!(
                t.token_id(name),
                Some(id.as_u64().unwrap() as u32),
                "{name}"
            );
        }
        assert_eq!(t.eos_token.as_deref(), Some("<|endoftext|>"));
    }

    #[test]
    fn chat_template_renders() {
        let t = tiny();
        let out = t
            .apply_chat_template(
                &[ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                }],
                true,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn pycompat_methods_work() {
        let out = ChatTemplate::parse(
            "{{ messages[0]['content'].strip().upper() }}{% if messages[0].get('x') is none %}!{% endif %}",
            "chat_template",
        )
        .unwrap()
        .render(
            minijinja::context! { messages => vec![ChatMessage { role: "u".into(), content: "  a b ".into() }] },
        )
        .unwrap();
        assert_eq!(out, "A B!");
    }

    #[test]
    fn streamed_text_equals_one_piece_decode() {
        let t = tiny();
        let text = "def f(x):\n    return x * 2  # héllo wörld ✓ 日本\n";
        let ids = t.encode(text, false).unwrap();
        let mut s = TextStream::new(vec![]);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&s.push(&t, id).unwrap().text);
        }
        out.push_str(&s.finish(&t).unwrap());
        assert_eq!(out, t.decode(&ids, true).unwrap());
    }

    /// A token of the tiny model's vocabulary whose bytes are a space and then the first byte of a 3-byte
    /// character (found, not assumed: the test fails if the vocabulary has none).
    fn space_then_partial_char(t: &Tokenizer) -> u32 {
        (0..t.vocab_size())
            .find(|&id| {
                let s = t.decode(&[id], true).unwrap_or_default();
                s.len() > 1 && s.starts_with(' ') && s[1..].chars().all(|c| c == '\u{FFFD}')
            })
            .expect("a token ' ' + an incomplete character")
    }

    /// The ids of `before`, then `split`, then the ids of `after`.
    fn around(t: &Tokenizer, before: &str, split: u32, after: &str) -> Vec<u32> {
        let mut ids = t.encode(before, false).unwrap();
        ids.push(split);
        ids.extend(t.encode(after, false).unwrap());
        ids
    }

    /// Streams `ids` until a stop string completes: (the text, the tokens pushed, the stream).
    fn until_stop(t: &Tokenizer, stops: &[&str], ids: &[u32]) -> (String, usize, TextStream) {
        let mut s = TextStream::new(stops.iter().map(|x| x.to_string()).collect());
        let (mut out, mut used) = (String::new(), 0);
        for &id in ids {
            used += 1;
            let d = s.push(t, id).unwrap();
            out.push_str(&d.text);
            if d.stopped {
                break;
            }
        }
        out.push_str(&s.finish(t).unwrap());
        (out, used, s)
    }

    #[test]
    fn text_before_an_incomplete_character_is_emitted_with_its_token() {
        let t = tiny();
        let split = space_then_partial_char(&t);
        // "a", then " " + the character's first byte: the space comes with `split`.
        let ids = around(&t, "a", split, "");
        let mut d = Detokenizer::new();
        let first = d.push(&t, ids[0]).unwrap();
        assert_eq!(d.push(&t, split).unwrap(), " ", "after {first:?}");
        // Ended right after it: the flush gives the incomplete character's lossy decode, once.
        assert_eq!(d.flush(&t).unwrap(), "\u{FFFD}");
        // Around other text, streamed: equal to the one-piece decode.
        let text = "x ✓ y ✓✓ 日本 z";
        let mut all = t.encode(text, false).unwrap();
        all.extend([split]);
        all.extend(t.encode("x", false).unwrap());
        let mut s = TextStream::new(vec![]);
        let mut out = String::new();
        for &id in &all {
            out.push_str(&s.push(&t, id).unwrap().text);
        }
        out.push_str(&s.finish(&t).unwrap());
        assert_eq!(out, t.decode(&all, true).unwrap());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
        /// Any run of tokens, half of them pieces of characters (tokens whose own decode is incomplete UTF-8):
        /// after every token the text emitted is the decode so far less its trailing incomplete character, and
        /// at the end it is the one-piece decode.
        #[test]
        fn any_tokens_stream_to_their_one_piece_decode(
            picks in proptest::collection::vec((proptest::prelude::any::<u32>(), proptest::prelude::any::<bool>()), 1..40),
        ) {
            let t = tiny();
            let pieces: Vec<u32> = (0..t.vocab_size())
                .filter(|&id| t.decode(&[id], true).unwrap_or_default().contains('\u{FFFD}'))
                .collect();
            proptest::prop_assert!(!pieces.is_empty());
            let ids: Vec<u32> = picks
                .iter()
                .map(|&(x, piece)| if piece { pieces[x as usize % pieces.len()] } else { x % t.vocab_size() })
                .collect();
            let mut d = Detokenizer::new();
            let mut out = String::new();
            for k in 0..ids.len() {
                out.push_str(&d.push(&t, ids[k]).unwrap());
                let so_far = t.decode(&ids[..=k], true).unwrap();
                proptest::prop_assert_eq!(out.as_str(), so_far.trim_end_matches('\u{FFFD}'));
            }
            out.push_str(&d.flush(&t).unwrap());
            proptest::prop_assert_eq!(out, t.decode(&ids, true).unwrap());
        }
    }

    #[test]
    fn a_stop_string_ends_at_the_token_that_starts_a_character_after_it() {
        let t = tiny();
        let split = space_then_partial_char(&t);
        let ids = around(&t, "q", split, "RIGHT");
        let (out, used, s) = until_stop(&t, &[" "], &ids);
        assert_eq!(out, "q");
        assert_eq!(
            s.ids().last(),
            Some(&split),
            "the stop completes at the token holding the space"
        );
        assert_eq!(used, ids.len() - t.encode("RIGHT", false).unwrap().len());
    }

    /// A copy of the bundled model's tokenizer.json in a folder of its own, with `config` as its
    /// tokenizer_config.json (none when `None`).
    fn tokenizer_dir(config: Option<&str>) -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::copy(
            root().join("models/flashnext-tiny/tokenizer.json"),
            tmp.path().join("tokenizer.json"),
        )
        .unwrap();
        if let Some(c) = config {
            std::fs::write(tmp.path().join("tokenizer_config.json"), c).unwrap();
        }
        tmp
    }

    #[test]
    fn the_chat_template_beside_the_config_is_read() {
        // transformers saves the template as chat_template.jinja, which comes before one in tokenizer_config.json.
        let dir = tokenizer_dir(Some(r#"{"eos_token": "<|endoftext|>"}"#));
        assert!(matches!(
            Tokenizer::from_dir(dir.path())
                .unwrap()
                .apply_chat_template(&[], false),
            Err(TokenizerError::NoChatTemplate)
        ));
        let jinja = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}";
        std::fs::write(dir.path().join("chat_template.jinja"), jinja).unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        let msg = ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        };
        assert_eq!(
            t.apply_chat_template(std::slice::from_ref(&msg), false)
                .unwrap(),
            "[user]hi"
        );
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": "<{{ messages[0].content }}>"}"#,
        )
        .unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(
            t.apply_chat_template(std::slice::from_ref(&msg), false)
                .unwrap(),
            "[user]hi"
        );
        std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(t.apply_chat_template(&[msg], false).unwrap(), "<hi>");
    }

    #[test]
    fn a_chat_template_that_does_not_parse_is_named_at_load_and_when_used() {
        // Before: every chat request failed on it with a 400 blaming the client's messages. The load goes on (the
        // model serves completions); the error names the file, and every use of the template returns it.
        let dir = tokenizer_dir(Some(
            r#"{"chat_template": "{% for m in messages %}{{ m.content }}"}"#,
        ));
        let t = Tokenizer::from_dir(dir.path()).expect("the load goes on");
        let config = dir.path().join("tokenizer_config.json");
        let says = format!(
            "{} (its chat_template field): the chat template does not parse: syntax error: unexpected end of input, \
             expected end of block (in chat_template:1)",
            config.display()
        );
        assert_eq!(
            t.chat_template_error().map(|e| e.to_string()),
            Some(says.clone())
        );
        let msg = ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        };
        match t.apply_chat_template(std::slice::from_ref(&msg), false) {
            Err(e @ TokenizerError::TemplateSyntax { .. }) => assert_eq!(e.to_string(), says),
            other => panic!("{other:?}"),
        }
        assert!(!t.encode("hi", false).expect("encodes").is_empty());
        // A chat_template.jinja comes before the config's template: only the one in force is parsed.
        let jinja = dir.path().join("chat_template.jinja");
        std::fs::write(&jinja, "[{{ messages[0].content }}]").unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        assert!(t.chat_template_error().is_none());
        assert_eq!(
            t.apply_chat_template(std::slice::from_ref(&msg), false)
                .unwrap(),
            "[hi]"
        );
        std::fs::write(&jinja, "BROKEN {{ \n").unwrap();
        match Tokenizer::from_dir(dir.path()).map(|t| t.chat_template_error()) {
            Ok(Some(TokenizerError::TemplateSyntax { origin, message })) => {
                assert_eq!(origin, jinja.display().to_string());
                assert!(
                    message.starts_with("syntax error: unexpected end of input")
                        && message.ends_with("(in chat_template.jinja:1)"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn templates_render_with_loop_controls_and_generation_tags_as_transformers_does() {
        // transformers renders chat templates with jinja2's loopcontrols extension and its own `generation` tag
        // (whose body renders unchanged). The expected text is jinja2 3.1.6's, in that environment (trim_blocks,
        // lstrip_blocks, loopcontrols and a `generation` extension rendering its body as transformers'
        // AssistantTracker does), for these messages and add_generation_prompt: whitespace control on the tags
        // (`-`, `+`, none), a tag without spaces, `break` and `continue`.
        let dir = tokenizer_dir(None);
        std::fs::write(dir.path().join("chat_template.jinja"), TEMPLATE).unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        assert!(t.chat_template_error().is_none());
        let msg = |role: &str, content: &str| ChatMessage {
            role: role.into(),
            content: content.into(),
        };
        let messages = [
            msg("user", "hi"),
            msg("assistant", "ok"),
            msg("user", "more"),
            msg("assistant", "dropped"),
        ];
        assert_eq!(t.apply_chat_template(&messages, true).unwrap(), EXPECTED);
        // A tag over several lines keeps them, so that an error gives the template's own line; a failure to parse
        // says how the tags were read.
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{%\n generation\n%}x{% endgeneration %}\n{{ broken",
        )
        .unwrap();
        let e = Tokenizer::from_dir(dir.path())
            .unwrap()
            .chat_template_error();
        match e {
            Some(TokenizerError::TemplateSyntax { message, .. }) => assert!(
                message.ends_with(
                    "(in chat_template.jinja:4) (its `{% generation %}` and `{% endgeneration %}` tags are read as \
                     `{% if true %}` and `{% endif %}`)"
                ),
                "{message}"
            ),
            other => panic!("{other:?}"),
        }
        // A tag-like text that is not a generation tag is left alone.
        assert_eq!(
            generation_tags_as_blocks("{% if x %}generation{% endif %}"),
            "{% if x %}generation{% endif %}"
        );
    }

    const TEMPLATE: &str = "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}{% if m.role == \"user\" and loop.index > 1 %}{% continue %}{% endif %}<|im_start|>{{ m.role }}\n{% if m.role == \"assistant\" %}  {%- generation -%}\n  [{{ m.content }}]\n  {%- endgeneration %}  {%generation%}+{%endgeneration%}\n{%+ generation +%} x {% endgeneration -%}\n  {% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    const EXPECTED: &str = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n[ok]  + x <|im_end|>\n<|im_start|>assistant\n";

    #[test]
    fn a_template_raising_refuses_the_messages_other_failures_are_the_templates() {
        let dir = tokenizer_dir(None);
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}\
             {% endif %}{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
        )
        .unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        let msg = |role: &str| ChatMessage {
            role: role.into(),
            content: "hi".into(),
        };
        match t.apply_chat_template(&[msg("assistant")], false) {
            Err(e @ TokenizerError::TemplateRaised(_)) => assert_eq!(
                e.to_string(),
                "the chat template refuses these messages: Conversations must start with a user turn"
            ),
            other => panic!("{other:?}"),
        }
        // A string plus a number: the template's own fault.
        match t.apply_chat_template(&[msg("user")], false) {
            Err(TokenizerError::Template(m)) => assert!(
                m.starts_with("invalid operation") && m.contains("chat_template.jinja:"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_template_the_engine_panics_on_is_a_fault_of_the_template() {
        // minijinja 2.24 panics on a `break` inside a `with` inside a loop (jinja2 renders "12"): the render's
        // error, not the caller's panic.
        let dir = tokenizer_dir(None);
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{% for m in messages %}{% with %}{{ m.content }}{% if loop.index == 2 %}{% break %}{% endif %}\
             {% endwith %}{% endfor %}",
        )
        .unwrap();
        let t = Tokenizer::from_dir(dir.path()).unwrap();
        let msg = |c: &str| ChatMessage {
            role: "user".into(),
            content: c.into(),
        };
        match t.apply_chat_template(&[msg("1"), msg("2"), msg("3")], false) {
            Err(TokenizerError::Template(m)) => assert_eq!(
                m,
                "the template engine (minijinja) failed on the chat_template.jinja template for these messages"
            ),
            other => panic!("{other:?}"),
        }
        // One message never reaches the break: rendered.
        assert_eq!(t.apply_chat_template(&[msg("1")], false).unwrap(), "1");
    }

    #[test]
    fn a_config_of_the_wrong_shape_is_named() {
        for (config, says) in [
            ("[1, 2]", "the file is an array, expected a JSON object"),
            (
                r#"{"chat_template": 42}"#,
                "chat_template is a number, expected a string",
            ),
            (
                r#"{"chat_template": []}"#,
                "chat_template is a list without a template string",
            ),
        ] {
            let dir = tokenizer_dir(Some(config));
            let e = Tokenizer::from_dir(dir.path()).err().map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains(says)),
                "{config}: {e:?}"
            );
        }
    }

    #[test]
    fn a_long_text_is_found_too_long_in_pieces_and_never_wrongly() {
        // Code with line breaks and spaces, a run of CJK with neither (cut at character boundaries), and a run of
        // letters: each is never found longer than its whole encoding (no false refusal), and is found longer than
        // half of it.
        let t = tiny();
        let code: String = (0..12_000)
            .map(|i| format!("    value_{i} = compute(value_{}, {i}) + 1\n", i / 2))
            .collect();
        let cjk = "日本語のテキスト、漢字と仮名。".repeat(8_000);
        let letters = "abcdefghij".repeat(30_000);
        for text in [code, cjk, letters] {
            assert!(text.len() > 3 * COUNT_PIECE, "{} bytes", text.len());
            let whole = t.encode(&text, false).unwrap().len();
            assert!(!t.exceeds(&text, whole).unwrap(), "{whole} tokens");
            assert!(t.exceeds(&text, whole / 2).unwrap(), "{whole} tokens");
        }
        // One piece or less is left to the whole encoding.
        assert!(!t.exceeds("def f(x):", 0).unwrap());
    }

    #[test]
    fn stop_string_cuts_text_at_the_completing_token() {
        let t = tiny();
        let text = "alpha beta gamma delta";
        let ids = t.encode(text, false).unwrap();
        let (out, used, s) = until_stop(&t, &["gam"], &ids);
        assert_eq!(out, "alpha beta ");
        assert!(used < ids.len());
        assert_eq!(s.ids().len(), used);
    }
}
