//! The run's pictures: `loss.png` (train and eval loss against step) and `timeline.svg` (one step's
//! per-stream timeline, predicted above measured).
//!
//! Both are drawn here without a plotting crate: the PNG is a small RGB rasteriser with a 5x7 bitmap
//! font, compressed with `miniz_oxide`; the SVG is text.

use std::fmt::Write as _;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// RGB colour.
    pub color: [u8; 3],
    /// (x, y) points; non-finite or non-positive y are skipped (the y axis is logarithmic).
    pub points: Vec<(f64, f64)>,
    /// Draw a dot on every point (for sparse series).
    pub dots: bool,
}

/// An RGB raster.
struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Self {
        Self { w, h, px: vec![255; w * h * 3] }
    }

    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: [u8; 3]) {
        for y in y0.min(y1)..=y0.max(y1) {
            for x in x0.min(x1)..=x0.max(x1) {
                self.set(x, y, c);
            }
        }
    }

    /// A line `width` pixels thick (Bresenham with a square brush).
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), width: i64, c: [u8; 3]) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        let r = (width - 1) / 2;
        loop {
            self.rect(x - r, y - r, x - r + width - 1, y - r + width - 1, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Text with the 5x7 font at `scale`, top-left at (x, y). Returns the width drawn.
    fn text(&mut self, x: i64, y: i64, s: &str, scale: i64, c: [u8; 3]) -> i64 {
        let mut cx = x;
        for ch in s.chars() {
            let rows = glyph(ch);
            for (ry, bits) in rows.iter().enumerate() {
                for rx in 0..5 {
                    if bits & (0x10 >> rx) != 0 {
                        let (px, py) = (cx + rx * scale, y + ry as i64 * scale);
                        self.rect(px, py, px + scale - 1, py + scale - 1, c);
                    }
                }
            }
            cx += 6 * scale;
        }
        cx - x
    }

    fn png(&self) -> Vec<u8> {
        let mut raw = Vec::with_capacity((self.w * 3 + 1) * self.h);
        for row in self.px.chunks(self.w * 3) {
            raw.push(0); // filter: none
            raw.extend_from_slice(row);
        }
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut ihdr = Vec::new();
        ihdr.extend_from_slice(&(self.w as u32).to_be_bytes());
        ihdr.extend_from_slice(&(self.h as u32).to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB, deflate, no filter set, no interlace
        chunk(&mut out, b"IHDR", &ihdr);
        chunk(&mut out, b"IDAT", &miniz_oxide::deflate::compress_to_vec_zlib(&raw, 6));
        chunk(&mut out, b"IEND", &[]);
        out
    }
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let mut crc_input = kind.to_vec();
    crc_input.extend_from_slice(data);
    out.extend_from_slice(&crc32(&crc_input).to_be_bytes());
}

/// CRC-32 (ISO-HDLC, the PNG chunk checksum).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// 5x7 glyphs (bit 4 is the leftmost column); lower case is drawn as upper case.
fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_uppercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        ',' => [0, 0, 0, 0, 0x0C, 0x04, 0x08],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '+' => [0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0],
        '=' => [0, 0, 0x1F, 0, 0x1F, 0, 0],
        ':' => [0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '/' => [0, 0x01, 0x02, 0x04, 0x08, 0x10, 0],
        ' ' => [0; 7],
        _ => [0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F],
    }
}

/// Tick label for a y value on the log axis.
fn tick_label(v: f64) -> String {
    if v >= 1.0 { format!("{v:.0}") } else { format!("{v}") }
}

/// A line chart with a logarithmic y axis, as PNG bytes.
pub fn line_chart_png(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Vec<u8> {
    let (w, h) = (800usize, 500usize);
    let mut c = Canvas::new(w, h);
    let (left, right, top, bottom) = (80i64, w as i64 - 20, 50i64, h as i64 - 60);
    let pts =
        || series.iter().flat_map(|s| s.points.iter()).filter(|(x, y)| x.is_finite() && y.is_finite() && *y > 0.0);
    let (mut x_max, mut y_min, mut y_max) = (1.0f64, f64::INFINITY, 0.0f64);
    for &(x, y) in pts() {
        x_max = x_max.max(x);
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    if !y_min.is_finite() {
        (y_min, y_max) = (0.1, 10.0);
    }
    let (ly0, ly1) = (y_min.log10().floor(), y_max.log10().ceil().max(y_min.log10().floor() + 1.0));
    let sx = |x: f64| left + ((x / x_max) * (right - left) as f64).round() as i64;
    let sy = |y: f64| bottom - (((y.log10() - ly0) / (ly1 - ly0)) * (bottom - top) as f64).round() as i64;
    let (grid, ink) = ([225, 225, 225], [40, 40, 40]);
    // Grid: decades and their 2x / 5x.
    let mut decade = ly0;
    while decade <= ly1 {
        for m in [1.0, 2.0, 5.0] {
            let v = 10f64.powf(decade) * m;
            if v.log10() > ly1 + 1e-9 {
                continue;
            }
            let y = sy(v);
            c.line((left, y), (right, y), 1, grid);
            let label = tick_label(v);
            c.text(left - 8 - 6 * label.len() as i64, y - 3, &label, 1, ink);
        }
        decade += 1.0;
    }
    for i in 0..=5 {
        let v = x_max * f64::from(i) / 5.0;
        let x = sx(v);
        c.line((x, top), (x, bottom), 1, grid);
        let label = format!("{v:.0}");
        c.text(x - 3 * label.len() as i64, bottom + 8, &label, 1, ink);
    }
    c.line((left, bottom), (right, bottom), 1, ink);
    c.line((left, top), (left, bottom), 1, ink);
    let tw = 12 * title.chars().count() as i64;
    c.text((w as i64 - tw) / 2, 14, title, 2, ink);
    let xw = 6 * x_label.chars().count() as i64;
    c.text((left + right - xw) / 2, bottom + 26, x_label, 1, ink);
    c.text(8, top - 16, y_label, 1, ink);
    for s in series {
        let good: Vec<(i64, i64)> = s
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite() && *y > 0.0)
            .map(|&(x, y)| (sx(x), sy(y)))
            .collect();
        for pair in good.windows(2) {
            c.line(pair[0], pair[1], 2, s.color);
        }
        if s.dots || good.len() == 1 {
            for &(x, y) in &good {
                c.rect(x - 3, y - 3, x + 3, y + 3, s.color);
            }
        }
    }
    // Legend, top right.
    let mut ly = top + 8;
    for s in series {
        let lw = 6 * s.label.chars().count() as i64;
        let lx = right - lw - 30;
        c.rect(lx, ly + 2, lx + 18, ly + 4, s.color);
        c.text(lx + 24, ly, &s.label, 1, ink);
        ly += 14;
    }
    c.png()
}

/// One bar of a timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// Row (stream) index into the lane names.
    pub lane: usize,
    /// Start, seconds from the start of the step.
    pub start: f64,
    /// Duration, seconds.
    pub dur: f64,
    /// Operation name (tooltip).
    pub name: String,
    /// Drawn as exposed waiting (the compute stream waiting on another stream).
    pub wait: bool,
}

/// One panel of the timeline: a title and its bars.
#[derive(Debug, Clone)]
pub struct Panel {
    /// "predicted (simulator): ..." or "measured: ...".
    pub title: String,
    /// Bars.
    pub spans: Vec<Span>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The per-stream timeline of one step as SVG: one panel per entry of `panels`, all on one time scale.
pub fn timeline_svg(title: &str, lanes: &[&str], panels: &[Panel]) -> String {
    const COLORS: [&str; 5] = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756"];
    let (w, left, right, lane_h, gap) = (1100.0, 90.0, 50.0, 22.0, 46.0);
    let t_max = panels.iter().flat_map(|p| p.spans.iter()).map(|s| s.start + s.dur).fold(0.0f64, f64::max).max(1e-6);
    let panel_h = lanes.len() as f64 * lane_h;
    let h = 40.0 + panels.len() as f64 * (panel_h + gap) + 30.0;
    let sx = |t: f64| left + t / t_max * (w - left - right);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="monospace" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(out, r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#, w / 2.0, esc(title));
    for (pi, panel) in panels.iter().enumerate() {
        let y0 = 40.0 + pi as f64 * (panel_h + gap) + 18.0;
        let _ = writeln!(out, r#"<text x="{left}" y="{}" font-size="13">{}</text>"#, y0 - 6.0, esc(&panel.title));
        for (li, lane) in lanes.iter().enumerate() {
            let y = y0 + li as f64 * lane_h;
            let _ = writeln!(
                out,
                r##"<rect x="{left}" y="{y}" width="{}" height="{}" fill="#f4f4f4"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                w - left - right,
                lane_h - 2.0,
                left - 6.0,
                y + lane_h * 0.65,
                esc(lane)
            );
        }
        for s in &panel.spans {
            let y = y0 + s.lane as f64 * lane_h;
            let (x, bw) = (sx(s.start), (sx(s.start + s.dur) - sx(s.start)).max(0.5));
            let fill = if s.wait { "#d62728" } else { COLORS[s.lane % COLORS.len()] };
            let opacity = if s.wait { "0.45" } else { "0.9" };
            let _ = writeln!(
                out,
                r#"<rect x="{x:.2}" y="{:.2}" width="{bw:.2}" height="{:.2}" fill="{fill}" fill-opacity="{opacity}"><title>{} {:.3} ms</title></rect>"#,
                y + 1.0,
                lane_h - 4.0,
                esc(&s.name),
                s.dur * 1e3
            );
        }
    }
    // Time axis under the last panel.
    let ya = 40.0 + panels.len() as f64 * (panel_h + gap) + 4.0;
    let _ = writeln!(out, r#"<line x1="{left}" y1="{ya}" x2="{}" y2="{ya}" stroke="black"/>"#, w - right);
    for i in 0..=10 {
        let t = t_max * f64::from(i) / 10.0;
        let x = sx(t);
        let _ = writeln!(
            out,
            r#"<line x1="{x:.1}" y1="{ya}" x2="{x:.1}" y2="{}" stroke="black"/><text x="{x:.1}" y="{}" text-anchor="middle">{:.1} ms</text>"#,
            ya + 4.0,
            ya + 17.0,
            t * 1e3
        );
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_is_well_formed_and_decodes_to_the_canvas() {
        let s = Series {
            label: "train".into(),
            color: [200, 0, 0],
            points: vec![(1.0, 5.0), (50.0, 0.5), (100.0, 0.05)],
            dots: false,
        };
        let png = line_chart_png("loss", "step", "loss", &[s]);
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // Walk the chunks, checking every CRC, and inflate IDAT back to the raw scanlines.
        let mut i = 8;
        let (mut dims, mut idat, mut kinds) = ((0u32, 0u32), Vec::new(), Vec::new());
        while i < png.len() {
            let len = u32::from_be_bytes(png[i..i + 4].try_into().unwrap()) as usize;
            let kind = &png[i + 4..i + 8];
            let data = &png[i + 8..i + 8 + len];
            let crc = u32::from_be_bytes(png[i + 8 + len..i + 12 + len].try_into().unwrap());
            assert_eq!(crc, crc32(&png[i + 4..i + 8 + len]));
            if kind == b"IHDR" {
                dims = (
                    u32::from_be_bytes(data[..4].try_into().unwrap()),
                    u32::from_be_bytes(data[4..8].try_into().unwrap()),
                );
            }
            if kind == b"IDAT" {
                idat.extend_from_slice(data);
            }
            kinds.push(String::from_utf8_lossy(kind).into_owned());
            i += 12 + len;
        }
        assert_eq!(kinds, ["IHDR", "IDAT", "IEND"]);
        let raw = miniz_oxide::inflate::decompress_to_vec_zlib(&idat).unwrap();
        assert_eq!(raw.len(), (dims.0 as usize * 3 + 1) * dims.1 as usize);
        // The series colour was drawn.
        assert!(raw.chunks(3).any(|p| p == [200, 0, 0]));
        // Known CRC-32 check value.
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn timeline_has_one_bar_per_span_and_escapes_names() {
        let spans = vec![
            Span { lane: 0, start: 0.0, dur: 0.01, name: "fwd L0".into(), wait: false },
            Span { lane: 0, start: 0.01, dur: 0.002, name: "wait <h2d>".into(), wait: true },
            Span { lane: 1, start: 0.0, dur: 0.005, name: "upload L1".into(), wait: false },
        ];
        let svg = timeline_svg(
            "step 3",
            &["compute", "h2d"],
            &[Panel { title: "predicted".into(), spans: spans.clone() }, Panel { title: "measured".into(), spans }],
        );
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<title>").count(), 6);
        assert!(svg.contains("wait &lt;h2d&gt;"));
        assert!(!svg.contains("<h2d>"));
    }
}
