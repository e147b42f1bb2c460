//! How a replica's log lines are written: text for a person, or one JSON
//! object per line for a collector. A line written while a request is
//! served names it first, as `request{request_id=.. method=..}` in text and
//! as the `span` of a JSON line (where no inner span is open), read from
//! the request's task-local (see `request_id`) rather than from a tracing
//! span. Spans opened inside a request follow it, as tracing's own
//! formats write them.
//!
//! The text layout is tracing's full format (time, level, spans, target,
//! fields); the JSON one has its keys (`timestamp`, `level`, `fields`,
//! `target`, `span`).

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

use crate::request_id::{with_current, Call, Served};

/// The name a request goes by in a line, as its span did.
const REQUEST: &str = "request";

/// The event format of a replica's log (`rota server --log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLines {
    Text,
    /// Needs the layer's span fields in JSON (`fmt_fields(JsonFields::new())`).
    Json,
}

impl<S, N> FormatEvent<S, N> for LogLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        match self {
            LogLines::Text => text_line(ctx, writer, event),
            LogLines::Json => json_line(ctx, writer, event),
        }
    }
}

fn text_line<S, N>(ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    let ansi = writer.has_ansi_escapes();
    let (dim, bold, reset) = if ansi { ("\x1b[2m", "\x1b[1m", "\x1b[0m") } else { ("", "", "") };
    write!(writer, "{dim}")?;
    SystemTime.format_time(&mut writer)?;
    write!(writer, "{reset} ")?;
    let level = event.metadata().level();
    match ansi {
        true => write!(writer, "\x1b[{}m{level:>5}\x1b[0m ", level_colour(level))?,
        false => write!(writer, "{level:>5} ")?,
    }
    let mut any_span = with_current(|served| match served {
        Some(served) => write!(writer, "{bold}{REQUEST}{reset}{{{}}}{dim}:{reset}", TextFields(served)).map(|()| true),
        None => Ok(false),
    })?;
    for span in ctx.event_scope().into_iter().flat_map(|scope| scope.from_root()) {
        write!(writer, "{bold}{}{reset}", span.name())?;
        let extensions = span.extensions();
        if let Some(fields) = extensions.get::<FormattedFields<N>>().filter(|fields| !fields.is_empty()) {
            write!(writer, "{{{fields}}}")?;
        }
        write!(writer, "{dim}:{reset}")?;
        any_span = true;
    }
    if any_span {
        writer.write_char(' ')?;
    }
    write!(writer, "{dim}{}:{reset} ", event.metadata().target())?;
    ctx.format_fields(writer.by_ref(), event)?;
    writeln!(writer)
}

fn level_colour(level: &Level) -> u8 {
    match *level {
        Level::TRACE => 35,
        Level::DEBUG => 34,
        Level::INFO => 32,
        Level::WARN => 33,
        Level::ERROR => 31,
    }
}

/// A request's fields as text: `request_id=.. method=..` (and `path=..`).
struct TextFields<'a>(&'a Served);

impl fmt::Display for TextFields<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request_id={}", self.0.id.id)?;
        match &self.0.call {
            Call::Grpc { method } => write!(f, " method={}", path_of(method)),
            Call::Rest { method, path } => write!(f, " method={method} path={}", path_of(path)),
        }
    }
}

/// The path alone: a query is never written to the log.
fn path_of(called: &Option<http::uri::PathAndQuery>) -> &str {
    called.as_ref().map_or("", |called| called.path())
}

fn json_line<S, N>(ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    let mut timestamp = String::new();
    SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
    let mut fields = JsonVisitor(Map::new());
    event.record(&mut fields);
    let mut line = Map::new();
    line.insert("timestamp".into(), Value::String(timestamp));
    line.insert("level".into(), Value::String(event.metadata().level().to_string()));
    line.insert("fields".into(), Value::Object(fields.0));
    line.insert("target".into(), Value::String(event.metadata().target().to_string()));
    // The event's own innermost span (its explicit parent, if it names one).
    let inner = ctx.event_scope().and_then(|mut scope| scope.next()).map(|span| {
        let mut object = span
            .extensions()
            .get::<FormattedFields<N>>()
            .and_then(|fields| serde_json::from_str::<Map<String, Value>>(fields).ok())
            .unwrap_or_default();
        object.insert("name".into(), Value::String(span.name().to_string()));
        object
    });
    if let Some(span) = inner.or_else(|| with_current(|served| served.map(json_request))) {
        line.insert("span".into(), Value::Object(span));
    }
    let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
    writeln!(writer, "{text}")
}

/// A request as a JSON line's `span`, with the keys its span had.
fn json_request(served: &Served) -> Map<String, Value> {
    let mut object = Map::new();
    object.insert("request_id".into(), Value::String(served.id.id.clone()));
    match &served.call {
        Call::Grpc { method } => {
            object.insert("method".into(), Value::String(path_of(method).to_string()));
        }
        Call::Rest { method, path } => {
            object.insert("method".into(), Value::String(method.to_string()));
            object.insert("path".into(), Value::String(path_of(path).to_string()));
        }
    }
    object.insert("name".into(), Value::String(REQUEST.into()));
    object
}

/// An event's fields as a JSON object: numbers and booleans as such, the
/// rest as text.
struct JsonVisitor(Map<String, Value>);

impl Visit for JsonVisitor {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), Value::Bool(value));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), Value::String(value.into()));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().into(), Value::String(format!("{value:?}")));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::format::JsonFields;
    use tracing_subscriber::fmt::MakeWriter;
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;
    use crate::request_id::{serve_as, RequestId};

    /// Lines written to memory.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Lines {
        type Writer = Lines;
        fn make_writer(&'a self) -> Lines {
            self.clone()
        }
    }

    impl Lines {
        fn take(&self) -> Vec<String> {
            let bytes = std::mem::take(&mut *self.0.lock().unwrap());
            String::from_utf8(bytes).unwrap().lines().map(str::to_string).collect()
        }
    }

    fn submit_call() -> Served {
        let method = Some(http::uri::PathAndQuery::from_static("/rota.v1.JobService/SubmitJob"));
        Served { id: RequestId { id: "r-1".into(), from_client: true }, call: Call::Grpc { method } }
    }

    /// Three events: in a request, in a span inside a request, outside any.
    fn log_three(served: Served) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(serve_as(served, async {
            tracing::info!(x = 3, "hello");
            tracing::info_span!("inner", k = 1).in_scope(|| tracing::warn!(ok = true, "within"));
        }));
        tracing::info!(y = "z", "outside");
    }

    fn text_lines(served: Served) -> Vec<String> {
        let lines = Lines::default();
        let layer = tracing_subscriber::fmt::layer().event_format(LogLines::Text).with_ansi(false).with_writer(lines.clone());
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || log_three(served));
        lines.take()
    }

    /// Everything after the timestamp.
    fn untimed(line: &str) -> &str {
        line.split_once(' ').map_or(line, |(_, rest)| rest)
    }

    #[test]
    fn a_text_line_names_its_request_first_then_its_spans() {
        let lines = text_lines(submit_call());
        assert_eq!(lines.len(), 3, "{lines:?}");
        let target = "rota_server::log_format::tests";
        assert_eq!(
            untimed(&lines[0]),
            format!(" INFO request{{request_id=r-1 method=/rota.v1.JobService/SubmitJob}}: {target}: hello x=3")
        );
        assert_eq!(
            untimed(&lines[1]),
            format!(" WARN request{{request_id=r-1 method=/rota.v1.JobService/SubmitJob}}:inner{{k=1}}: {target}: within ok=true")
        );
        assert_eq!(untimed(&lines[2]), format!(" INFO {target}: outside y=\"z\""));
        let rest = Served {
            call: Call::Rest { method: http::Method::GET, path: Some("/v1/jobs?state=pending".parse().unwrap()) },
            ..submit_call()
        };
        let lines = text_lines(rest);
        assert!(lines[0].contains(" request{request_id=r-1 method=GET path=/v1/jobs}: "), "no query: {}", lines[0]);
    }

    /// Outside requests, the lines are tracing's own full format.
    #[test]
    fn a_text_line_is_laid_out_as_tracings_full_format() {
        let ours = text_lines(submit_call());
        let lines = Lines::default();
        let theirs = tracing_subscriber::fmt::layer().with_ansi(false).with_writer(lines.clone());
        tracing::subscriber::with_default(tracing_subscriber::registry().with(theirs), || {
            tracing::info_span!("inner", k = 1).in_scope(|| tracing::warn!(ok = true, "within"));
            tracing::info!(y = "z", "outside");
        });
        let theirs = lines.take();
        assert_eq!(untimed(&theirs[0]), untimed(&ours[1]).replace("request{request_id=r-1 method=/rota.v1.JobService/SubmitJob}:", ""));
        assert_eq!(untimed(&theirs[1]), untimed(&ours[2]));
        assert_eq!(ours[0].split(' ').next().map(str::len), theirs[0].split(' ').next().map(str::len), "the same timestamps");
    }

    #[test]
    fn a_json_line_carries_the_request_as_its_span_unless_an_inner_one_is_open() {
        let lines = Lines::default();
        let layer = tracing_subscriber::fmt::layer().event_format(LogLines::Json).fmt_fields(JsonFields::new()).with_writer(lines.clone());
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || log_three(submit_call()));
        let lines: Vec<Value> = lines.take().iter().map(|line| serde_json::from_str(line).expect("one JSON object a line")).collect();
        assert_eq!(lines.len(), 3);
        let first = &lines[0];
        assert_eq!(
            (first["level"].as_str(), first["fields"]["message"].as_str(), first["fields"]["x"].as_u64()),
            (Some("INFO"), Some("hello"), Some(3))
        );
        assert_eq!(first["target"], "rota_server::log_format::tests");
        assert_eq!(first["span"], serde_json::json!({"request_id": "r-1", "method": "/rota.v1.JobService/SubmitJob", "name": "request"}));
        assert!(first["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')));
        assert_eq!(lines[1]["span"], serde_json::json!({"k": 1, "name": "inner"}));
        assert_eq!(lines[1]["fields"]["ok"], true);
        assert!(lines[2].get("span").is_none(), "no request, no span: {}", lines[2]);
    }
}
