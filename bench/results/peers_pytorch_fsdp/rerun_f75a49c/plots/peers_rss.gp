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
plot for [i=2:15] 'peers_rss.dat' using i:xtic(1) title columnhead(i)
