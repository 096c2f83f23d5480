//! The W3C trace context a job carries, and the headers it travels in.

/// W3C trace context (Trace Context level 1): where the job's trace came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// `00-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>`.
    pub traceparent: String,
    /// Vendor data, passed on unchanged.
    pub tracestate: Option<String>,
}

/// Kafka header (and HTTP header) carrying [`TraceContext::traceparent`].
pub const TRACEPARENT: &str = "traceparent";
/// Kafka header (and HTTP header) carrying [`TraceContext::tracestate`].
pub const TRACESTATE: &str = "tracestate";

impl TraceContext {
    /// A context from received headers; `None` if `traceparent` is not valid W3C (which, per
    /// the recommendation, starts a new trace rather than failing the request).
    pub fn from_headers(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let context = Self {
            traceparent: traceparent.trim().to_ascii_lowercase(),
            tracestate: tracestate.map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned),
        };
        context.ids().is_some().then_some(context)
    }

    /// The trace id and the parent span id, if the traceparent is valid.
    pub fn ids(&self) -> Option<(&str, &str)> {
        let mut parts = self.traceparent.split('-');
        let (version, trace_id, parent_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        let zero = |s: &str| s.bytes().all(|b| b == b'0');
        let valid = hex(version, 2)
            && version != "ff"
            // Version 00 has exactly four fields; later versions may append more.
            && (version != "00" || parts.next().is_none())
            && hex(trace_id, 32)
            && !zero(trace_id)
            && hex(parent_id, 16)
            && !zero(parent_id)
            && hex(flags, 2);
        valid.then_some((trace_id, parent_id))
    }

    /// The context to send onward from a span `span_id` (16 hex) of this trace: same trace
    /// id, flags and tracestate, the span as parent. `None` if this context is not valid.
    pub fn child(&self, span_id: &str) -> Option<Self> {
        let (trace_id, _) = self.ids()?;
        let flags = self.traceparent.split('-').nth(3)?;
        Some(Self {
            traceparent: format!("00-{trace_id}-{span_id}-{flags}"),
            tracestate: self.tracestate.clone(),
        })
    }
}
