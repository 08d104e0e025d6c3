set terminal pngcairo noenhanced size 1000,560 font 'DejaVu Sans,10'
set output '../peers_rss.png'
set title 'Peak resident memory per rank (VmHWM, largest over ranks, MiB)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set key below
set ylabel 'MiB'
set yrange [0:*]
set grid ytics
plot 'peers_rss.dat' using 2:xtic(1) title columnhead(2) lc rgb '#7f7f7f' fs solid 0.8, \
     'peers_rss.dat' using 3:xtic(1) title columnhead(3) lc rgb '#17becf' fs solid 0.8, \
     'peers_rss.dat' using 4:xtic(1) title columnhead(4) lc rgb '#d62728' fs pattern 2, \
     'peers_rss.dat' using 5:xtic(1) title columnhead(5) lc rgb '#1f77b4' fs pattern 2, \
     'peers_rss.dat' using 6:xtic(1) title columnhead(6) lc rgb '#9467bd' fs pattern 2, \
     'peers_rss.dat' using 7:xtic(1) title columnhead(7) lc rgb '#2ca02c' fs pattern 2, \
     'peers_rss.dat' using 8:xtic(1) title columnhead(8) lc rgb '#d62728' fs solid 0.8, \
     'peers_rss.dat' using 9:xtic(1) title columnhead(9) lc rgb '#1f77b4' fs solid 0.8, \
     'peers_rss.dat' using 10:xtic(1) title columnhead(10) lc rgb '#9467bd' fs solid 0.8, \
     'peers_rss.dat' using 11:xtic(1) title columnhead(11) lc rgb '#2ca02c' fs solid 0.8, \
     'peers_rss.dat' using 12:xtic(1) title columnhead(12) lc rgb '#d62728' fs pattern 4, \
     'peers_rss.dat' using 13:xtic(1) title columnhead(13) lc rgb '#1f77b4' fs pattern 4, \
     'peers_rss.dat' using 14:xtic(1) title columnhead(14) lc rgb '#9467bd' fs pattern 4, \
     'peers_rss.dat' using 15:xtic(1) title columnhead(15) lc rgb '#2ca02c' fs pattern 4
