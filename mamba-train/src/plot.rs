//! The loss curve as a small hand-written SVG: raw per-step loss (light),
//! a trailing moving average (dark), axes with five ticks each. The output
//! is a pure function of the points (fixed-precision formatting, no
//! timestamps), so two identical runs write identical files.

use std::fmt::Write as _;

const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 36.0;
const BOTTOM: f64 = 48.0;

/// SVG of `points` (`(step, loss)`, ascending steps). Non-finite losses are
/// left out; with no finite point the plot says so.
pub fn loss_svg(title: &str, points: &[(u64, f64)]) -> String {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .filter(|(_, l)| l.is_finite())
        .map(|&(s, l)| (s as f64, l))
        .collect();
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        W / 2.0,
        escape(title)
    );
    if pts.is_empty() {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">no finite loss recorded</text>"#,
            W / 2.0,
            H / 2.0
        );
        svg.push_str("</svg>\n");
        return svg;
    }
    let x0 = pts[0].0;
    let x1 = pts[pts.len() - 1].0.max(x0 + 1.0);
    let lo = pts.iter().fold(f64::MAX, |a, p| a.min(p.1)).min(0.0);
    let hi = pts.iter().fold(f64::MIN, |a, p| a.max(p.1));
    // The y axis spans whole "nice" ticks (1, 2 or 5 times a power of ten).
    let ystep = nice_step(hi - lo);
    let ymin = (lo / ystep).floor() * ystep;
    let ymax = ((hi / ystep).ceil() * ystep).max(ymin + ystep);
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
    let sy = |y: f64| TOP + (1.0 - (y - ymin) / (ymax - ymin)) * ph;

    // Axes and ticks.
    let _ = writeln!(
        svg,
        r#"<path d="M{LEFT:.1} {TOP:.1} V{:.1} H{:.1}" stroke="black" fill="none"/>"#,
        TOP + ph,
        LEFT + pw
    );
    let ny = ((ymax - ymin) / ystep).round() as u64;
    for i in 0..=ny {
        let yv = ymin + i as f64 * ystep;
        let y = sy(yv);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            tick(yv, ystep)
        );
    }
    let xstep = nice_step(x1 - x0).max(1.0);
    let mut k = (x0 / xstep).ceil() as u64;
    while k as f64 * xstep <= x1 {
        let xv = k as f64 * xstep;
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            sx(xv),
            TOP + ph + 18.0,
            xv as u64
        );
        k += 1;
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#,
        LEFT + pw / 2.0,
        H - 8.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="14" y="{:.1}" text-anchor="middle" transform="rotate(-90 14 {:.1})">loss</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );

    // Raw loss, then a trailing moving average over ~2% of the points.
    let window = (pts.len() / 50).max(1);
    let _ = writeln!(
        svg,
        r##"<polyline fill="none" stroke="#9ecae1" stroke-width="1" points="{}"/>"##,
        line(&pts, &sx, &sy)
    );
    if window > 1 {
        let mut avg = Vec::with_capacity(pts.len());
        let mut sum = 0.0;
        for (i, p) in pts.iter().enumerate() {
            sum += p.1;
            if i >= window {
                sum -= pts[i - window].1;
            }
            avg.push((p.0, sum / (i + 1).min(window) as f64));
        }
        let _ = writeln!(
            svg,
            r##"<polyline fill="none" stroke="#08519c" stroke-width="2" points="{}"/>"##,
            line(&avg, &sx, &sy)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn line(pts: &[(f64, f64)], sx: &dyn Fn(f64) -> f64, sy: &dyn Fn(f64) -> f64) -> String {
    let mut s = String::with_capacity(pts.len() * 14);
    for (i, &(x, y)) in pts.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        let _ = write!(s, "{:.1},{:.1}", sx(x), sy(y));
    }
    s
}

/// A tick step of 1, 2 or 5 times a power of ten giving about four
/// intervals over `range`.
fn nice_step(range: f64) -> f64 {
    if !(range.is_finite() && range > 0.0) {
        return 1.0;
    }
    let raw = range / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let f = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    f * mag
}

/// A tick label with as many decimals as the step needs.
fn tick(v: f64, step: f64) -> String {
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{v:.decimals$}")
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_well_formed() {
        let pts: Vec<(u64, f64)> = (1..=200).map(|s| (s, 3.0 / (s as f64).sqrt())).collect();
        let a = loss_svg("run <x>", &pts);
        assert_eq!(a, loss_svg("run <x>", &pts));
        assert!(a.starts_with("<svg") && a.trim_end().ends_with("</svg>"));
        assert!(a.contains("run &lt;x&gt;"));
        assert_eq!(a.matches("<polyline").count(), 2, "raw and smoothed");
        // The first point sits at the left edge, the highest at the top area.
        assert!(a.contains(&format!("{:.1},", LEFT)));
        assert_ne!(a, loss_svg("run <x>", &pts[..100]));
    }

    #[test]
    fn ticks_are_round_numbers() {
        assert_eq!(nice_step(3.76), 1.0);
        assert_eq!(nice_step(2000.0), 500.0);
        assert_eq!(nice_step(7.0), 2.0);
        assert!((nice_step(0.3) - 0.1).abs() < 1e-12);
        assert_eq!(tick(1.5, 0.5), "1.5");
        assert_eq!(tick(3.0, 1.0), "3");
        let s = loss_svg("t", &[(1, 3.76), (2000, 0.2)]);
        for label in [">0<", ">1<", ">4<", ">500<", ">2000<"] {
            assert!(s.contains(label), "{label} missing");
        }
    }

    #[test]
    fn copes_with_nan_and_a_single_point() {
        let s = loss_svg("t", &[(1, f64::NAN)]);
        assert!(s.contains("no finite loss"));
        let s = loss_svg("t", &[(1, 2.0)]);
        assert!(s.contains("<polyline") && !s.contains("NaN"));
    }
}
