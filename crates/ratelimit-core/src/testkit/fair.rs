//! What a fair share of one capacity is, from its definition, for the tests of shared capacity:
//! weighted max-min fairness by water-filling, and Jain's fairness index. Written from the
//! definitions, independent of the code they will check.
#![allow(clippy::indexing_slicing)]

/// The weighted max-min fair allocation of `capacity` among tenants asking `demands`, of
/// `weights` (positive): every tenant gets `min(demand, level × weight)` for the one level at
/// which the allocations fill the capacity, or its whole demand when all demands fit. A tenant
/// using less than its share leaves the rest to the others (work-conserving).
pub fn water_fill(capacity: f64, demands: &[f64], weights: &[f64]) -> Vec<f64> {
    assert_eq!(demands.len(), weights.len());
    let n = demands.len();
    let mut alloc = vec![0.0; n];
    let mut open: Vec<usize> = (0..n).filter(|&i| demands[i] > 0.0).collect();
    let mut left = capacity.max(0.0);
    // Each round: the level the open tenants' weights share; those whose demand is under it
    // are served whole and leave; when none is, the level is final.
    while !open.is_empty() && left > 0.0 {
        let weight: f64 = open.iter().map(|&i| weights[i]).sum();
        let level = left / weight;
        let (served, rest): (Vec<usize>, Vec<usize>) = open
            .iter()
            .partition(|&&i| demands[i] <= level * weights[i]);
        if served.is_empty() {
            for &i in &rest {
                alloc[i] = level * weights[i];
            }
            return alloc;
        }
        for &i in &served {
            alloc[i] = demands[i];
            left -= demands[i];
        }
        open = rest;
    }
    alloc
}

/// Jain's fairness index of `xs`: 1 when all are equal, 1/n when one has everything.
pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let squares: f64 = xs.iter().map(|x| x * x).sum();
    if squares == 0.0 {
        return 1.0;
    }
    sum * sum / (xs.len() as f64 * squares)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
    }

    #[test]
    fn water_filling_from_its_definition() {
        // Alone: all it asks, up to the capacity.
        assert!(close(&water_fill(100.0, &[500.0], &[1.0]), &[100.0]));
        assert!(close(&water_fill(100.0, &[30.0], &[1.0]), &[30.0]));
        // Ten equal tenants, all backlogged: a tenth each.
        assert!(close(
            &water_fill(100.0, &[1e9; 10], &[1.0; 10]),
            &[10.0; 10]
        ));
        // One heavy at ten times its share, nine light at half of theirs: the light ones get
        // their demand, the heavy one the rest.
        let mut d = vec![100.0];
        d.extend([5.0; 9]);
        let a = water_fill(100.0, &d, &[1.0; 10]);
        assert!(close(&a[1..], &[5.0; 9]) && (a[0] - 55.0).abs() < 1e-9);
        // Weights 1:2:4, backlogged: shares 1:2:4.
        assert!(close(
            &water_fill(70.0, &[1e9; 3], &[1.0, 2.0, 4.0]),
            &[10.0, 20.0, 40.0]
        ));
        // Weighted, one served whole: the others share what it leaves by weight.
        assert!(close(
            &water_fill(70.0, &[5.0, 1e9, 1e9], &[1.0, 2.0, 4.0]),
            &[5.0, 65.0 / 3.0, 130.0 / 3.0]
        ));
        // Demands that fit are met; nothing asked, nothing given.
        assert!(close(
            &water_fill(100.0, &[10.0, 0.0, 20.0], &[1.0; 3]),
            &[10.0, 0.0, 20.0]
        ));
    }

    #[test]
    fn jains_index() {
        assert!((jain(&[3.0; 7]) - 1.0).abs() < 1e-12);
        assert!((jain(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
        assert!(jain(&[10.0, 9.0, 11.0]) > 0.99);
        assert_eq!(jain(&[0.0, 0.0]), 1.0);
    }
}
