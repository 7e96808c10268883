//! A hand-written, self-contained SVG grouped bar chart (no plotting crates, no scripts, no external
//! fonts or styles).

use std::fmt::Write as _;

/// One bar: a group on the x axis (a model), a series within it (a policy), and its value (`None`:
/// the row was skipped or failed, drawn as a label instead of a bar).
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// Group label (x axis); one line per `\n`.
    pub group: String,
    /// Series label (legend).
    pub series: String,
    /// Height, or `None` for a row without a value.
    pub value: Option<f64>,
    /// Text under a missing bar (`skipped`).
    pub missing: String,
}

/// Series colours, colour-blind safe (Okabe-Ito).
const COLORS: [&str; 6] = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00"];

/// Escape text for XML content and attributes.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// A "nice" axis maximum and tick step for data up to `max`.
fn axis(max: f64) -> (f64, f64) {
    if !(max.is_finite() && max > 0.0) {
        return (1.0, 0.25);
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

fn fmt_value(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e9 { format!("{v:.0}") } else { format!("{v:.1}") }
}

/// Render a grouped bar chart. Groups and series keep their order of first appearance; each `Some`
/// value is one `<rect class="bar">`.
pub fn bar_chart(title: &str, subtitle: &str, y_label: &str, bars: &[Bar]) -> String {
    let mut groups: Vec<&str> = Vec::new();
    let mut series: Vec<&str> = Vec::new();
    for b in bars {
        if !groups.contains(&b.group.as_str()) {
            groups.push(&b.group);
        }
        if !series.contains(&b.series.as_str()) {
            series.push(&b.series);
        }
    }
    let label_lines = groups.iter().map(|g| g.lines().count()).max().unwrap_or(1).max(1) as f64;
    let (left, right, top, bottom) = (70.0, 20.0, 70.0, 46.0 + 14.0 * label_lines);
    let bar_w = 28.0;
    // About 7 px per character at font-size 12; a group is as wide as its longest label line.
    let text_w = |t: &str, px: f64| t.chars().count() as f64 * px;
    let label_w = groups.iter().flat_map(|g| g.lines()).map(|l| text_w(l, 7.0)).fold(0.0, f64::max);
    let group_w = ((series.len().max(1) as f64) * bar_w).max(label_w) + 30.0;
    let plot_w = (groups.len().max(1) as f64 * group_w).max(300.0);
    let plot_h = 300.0;
    let title_w = text_w(title, 9.0).max(text_w(subtitle, 7.0)) + 40.0;
    let width = (left + plot_w + right).max(title_w);
    let height = top + plot_h + bottom;
    let max = bars.iter().filter_map(|b| b.value).fold(0.0, f64::max);
    let (y_max, step) = axis(max);
    let y = |v: f64| top + plot_h - v / y_max * plot_h;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, "<title>{}</title>", escape(title));
    let _ = writeln!(s, r#"<rect x="0" y="0" width="{width:.0}" height="{height:.0}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
        width / 2.0,
        escape(title)
    );
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="40" text-anchor="middle" fill="#444">{}</text>"##,
        width / 2.0,
        escape(subtitle)
    );
    // Grid and y ticks.
    let mut v = 0.0;
    while v <= y_max + step * 1e-9 {
        let yy = y(v);
        let _ = writeln!(
            s,
            r##"<line x1="{left:.1}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            left + plot_w,
            left - 6.0,
            yy + 4.0,
            fmt_value(v)
        );
        v += step;
    }
    let _ = writeln!(
        s,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        top + plot_h / 2.0,
        escape(y_label)
    );
    // Bars.
    for (gi, g) in groups.iter().enumerate() {
        let gx = left + gi as f64 * group_w + 15.0;
        for (si, se) in series.iter().enumerate() {
            let Some(b) = bars.iter().find(|b| b.group == *g && b.series == *se) else { continue };
            let x = gx + si as f64 * bar_w;
            let color = COLORS[si % COLORS.len()];
            match b.value {
                Some(val) => {
                    let top_y = y(val.max(0.0));
                    let _ = writeln!(
                        s,
                        r#"<rect class="bar" x="{x:.1}" y="{top_y:.1}" width="{:.1}" height="{:.1}" fill="{color}"><title>{}: {} = {}</title></rect>"#,
                        bar_w - 4.0,
                        top + plot_h - top_y,
                        escape(g),
                        escape(se),
                        fmt_value(val)
                    );
                    let _ = writeln!(
                        s,
                        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}</text>"#,
                        x + (bar_w - 4.0) / 2.0,
                        top_y - 3.0,
                        fmt_value(val)
                    );
                }
                None => {
                    let _ = writeln!(
                        s,
                        r##"<text transform="translate({:.1} {:.1}) rotate(-90)" font-size="10" fill="#888">{}</text>"##,
                        x + (bar_w - 4.0) / 2.0 + 3.0,
                        top + plot_h - 4.0,
                        escape(&b.missing)
                    );
                }
            }
        }
        for (li, line) in g.lines().enumerate() {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                gx + series.len() as f64 * bar_w / 2.0,
                top + plot_h + 18.0 + 14.0 * li as f64,
                escape(line)
            );
        }
    }
    // Axes.
    let _ = writeln!(
        s,
        r#"<line x1="{left:.1}" y1="{top:.1}" x2="{left:.1}" y2="{:.1}" stroke="black"/><line x1="{left:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#,
        top + plot_h,
        top + plot_h,
        left + plot_w,
        top + plot_h
    );
    // Legend.
    for (si, se) in series.iter().enumerate() {
        let lx = left + si as f64 * 120.0;
        let ly = top + plot_h + 24.0 + 14.0 * label_lines;
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
            ly - 10.0,
            COLORS[si % COLORS.len()],
            lx + 16.0,
            escape(se)
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report
mod tests {
    use super::*;

    /// Minimal well-formedness check: every tag closes in order, attributes are quoted, entities are
    /// the five XML ones, and there is one root element.
    fn well_formed(xml: &str) -> Result<(), String> {
        let mut stack: Vec<String> = Vec::new();
        let mut rest = xml;
        let mut roots = 0;
        while let Some(i) = rest.find(['<', '&']) {
            let text = &rest[..i];
            if stack.is_empty() && !text.trim().is_empty() {
                return Err(format!("text outside the root: {text:?}"));
            }
            rest = &rest[i..];
            if rest.starts_with('&') {
                let end = rest.find(';').ok_or("unterminated entity")?;
                if !["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"].contains(&&rest[..=end]) {
                    return Err(format!("bad entity {}", &rest[..=end]));
                }
                rest = &rest[end + 1..];
                continue;
            }
            let end = rest.find('>').ok_or("unterminated tag")?;
            let tag = &rest[1..end];
            rest = &rest[end + 1..];
            if !tag.matches('"').count().is_multiple_of(2) || tag.contains('<') {
                return Err(format!("bad attributes in <{tag}>"));
            }
            if let Some(name) = tag.strip_prefix('/') {
                let open = stack.pop().ok_or(format!("</{name}> without an open tag"))?;
                if open != name {
                    return Err(format!("</{name}> closes <{open}>"));
                }
            } else {
                let name = tag.split_whitespace().next().unwrap_or("").trim_end_matches('/').to_string();
                if stack.is_empty() {
                    roots += 1;
                }
                if !tag.ends_with('/') {
                    stack.push(name);
                }
            }
        }
        if !stack.is_empty() {
            return Err(format!("unclosed {stack:?}"));
        }
        if roots != 1 {
            return Err(format!("{roots} root elements"));
        }
        Ok(())
    }

    fn bar(g: &str, s: &str, v: Option<f64>) -> Bar {
        Bar { group: g.into(), series: s.into(), value: v, missing: "skipped".into() }
    }

    #[test]
    fn chart_is_well_formed_with_one_bar_per_row() {
        let bars = vec![
            bar("qwen2.5-3b", "auto", Some(206.0)),
            bar("qwen2.5-3b", "megatrain", Some(167.0)),
            bar("qwen2.5-7b", "auto", Some(223.8)),
            bar("qwen2.5-7b", "megatrain", Some(180.0)),
            bar("qwen3.6-27b <&>", "auto", None),
            bar("qwen3.6-27b <&>", "megatrain", None),
        ];
        let svg = bar_chart("TFLOPS \"predicted\" <h800>", "seq 1024 & batch 72", "TFLOPS", &bars);
        well_formed(&svg).unwrap();
        assert_eq!(svg.matches(r#"class="bar""#).count(), 4);
        assert!(svg.contains("qwen3.6-27b &lt;&amp;&gt;"));
        assert_eq!(svg.matches(">skipped<").count(), 2);
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        // The checker itself rejects broken documents.
        assert!(well_formed("<svg><g></svg>").is_err());
        assert!(well_formed("<svg>a & b</svg>").is_err());
    }

    #[test]
    fn empty_and_zero_charts_are_well_formed() {
        well_formed(&bar_chart("t", "s", "y", &[])).unwrap();
        let svg = bar_chart("t", "s", "y", &[bar("a", "auto", Some(0.0))]);
        well_formed(&svg).unwrap();
        assert_eq!(svg.matches(r#"class="bar""#).count(), 1);
    }

    #[test]
    fn axis_is_round_and_covers_the_data() {
        for max in [0.3, 7.0, 135.0, 223.8, 999.0] {
            let (top, step) = axis(max);
            assert!(top >= max && top / step <= 10.0, "{max}: {top} {step}");
        }
    }
}
